/* The smoke programs' own Vulkan device, made as an emulator makes its own before it meets
 * emuhost: an instance (Vulkan 1.1), a device with VK_EXT_external_memory_host and one queue. And
 * a read of an imported buffer back through the GPU (a copy on that queue into a buffer of the
 * program's own). C, shared by tests/c/smoke.c and tests/cpp/smoke.cpp. */
#ifndef SMOKE_VKDEV_H
#define SMOKE_VKDEV_H

#include <stddef.h>
#include <stdint.h>
#include <vulkan/vulkan.h>

#ifdef __cplusplus
extern "C" {
#endif

struct smoke_vk {
    VkInstance instance;
    VkPhysicalDevice physical_device;
    VkDevice device;
    VkQueue queue;
    uint32_t family;
    const char *extensions[2];
    uint32_t extension_count;
    char name[VK_MAX_PHYSICAL_DEVICE_NAME_SIZE];
};

/* 0 on success; otherwise why in `why`, and nothing is left made. */
int smoke_vk_open(struct smoke_vk *vk, char *why, size_t cap);

/* Copies `len` bytes of `buffer` (a VkBuffer, raw) from `offset` into `out` through the GPU: a
 * vkCmdCopyBuffer on the program's queue into a host-visible buffer, then a map. 0 on success. */
int smoke_vk_read(struct smoke_vk *vk, uint64_t buffer, uint64_t offset, void *out, size_t len, char *why, size_t cap);

void smoke_vk_close(struct smoke_vk *vk);

#ifdef __cplusplus
}
#endif

#endif
