//! What import and shader preparation share about the GPU: one Vulkan module ([`vulkan`]) with
//! the process's instance, the choice of physical device and the mapping of its errors.

pub mod vulkan;
