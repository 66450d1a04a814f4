//! emuhost-prepare's integration tests, in one binary: shader preparation on a real Vulkan device.

mod prepare;
#[path = "../../../emuhost/tests/support/vulkan.rs"]
mod vulkan_gate;
