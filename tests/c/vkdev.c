/* See vkdev.h. */
#include "vkdev.h"

#include <stdio.h>
#include <string.h>

#define FAIL(...)                              \
    do {                                       \
        snprintf(why, cap, __VA_ARGS__);       \
        goto fail;                             \
    } while (0)

static int has_extension(VkPhysicalDevice pd, const char *name) {
    uint32_t n = 0;
    if (vkEnumerateDeviceExtensionProperties(pd, NULL, &n, NULL) != VK_SUCCESS || n > 512) return 0;
    VkExtensionProperties props[512];
    if (vkEnumerateDeviceExtensionProperties(pd, NULL, &n, props) != VK_SUCCESS) return 0;
    for (uint32_t i = 0; i < n; i++)
        if (strcmp(props[i].extensionName, name) == 0) return 1;
    return 0;
}

int smoke_vk_open(struct smoke_vk *vk, char *why, size_t cap) {
    memset(vk, 0, sizeof *vk);
    VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .pApplicationName = "emuhost smoke",
                             .apiVersion = VK_API_VERSION_1_1};
    VkInstanceCreateInfo ici = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &app};
    VkResult r = vkCreateInstance(&ici, NULL, &vk->instance);
    if (r != VK_SUCCESS) {
        vk->instance = VK_NULL_HANDLE;
        FAIL("vkCreateInstance: %d", (int)r);
    }
    VkPhysicalDevice pds[16];
    uint32_t n = 16;
    r = vkEnumeratePhysicalDevices(vk->instance, &n, pds);
    if (r != VK_SUCCESS && r != VK_INCOMPLETE) FAIL("vkEnumeratePhysicalDevices: %d", (int)r);
    for (uint32_t i = 0; i < n && !vk->physical_device; i++) {
        VkPhysicalDeviceProperties props;
        vkGetPhysicalDeviceProperties(pds[i], &props);
        if (props.apiVersion < VK_API_VERSION_1_1 || !has_extension(pds[i], VK_EXT_EXTERNAL_MEMORY_HOST_EXTENSION_NAME))
            continue;
        VkQueueFamilyProperties families[16];
        uint32_t nf = 16;
        vkGetPhysicalDeviceQueueFamilyProperties(pds[i], &nf, families);
        for (uint32_t f = 0; f < nf; f++) {
            VkQueueFlags any = VK_QUEUE_GRAPHICS_BIT | VK_QUEUE_COMPUTE_BIT | VK_QUEUE_TRANSFER_BIT;
            if (families[f].queueCount > 0 && (families[f].queueFlags & any)) {
                vk->physical_device = pds[i];
                vk->family = f;
                snprintf(vk->name, sizeof vk->name, "%s", props.deviceName);
                break;
            }
        }
    }
    if (!vk->physical_device) FAIL("no Vulkan 1.1 device with %s (of %u)", VK_EXT_EXTERNAL_MEMORY_HOST_EXTENSION_NAME, n);
    vk->extensions[vk->extension_count++] = VK_EXT_EXTERNAL_MEMORY_HOST_EXTENSION_NAME;
    if (has_extension(vk->physical_device, VK_KHR_EXTERNAL_MEMORY_EXTENSION_NAME))
        vk->extensions[vk->extension_count++] = VK_KHR_EXTERNAL_MEMORY_EXTENSION_NAME;
    float prio = 1.0f;
    VkDeviceQueueCreateInfo qci = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, .queueFamilyIndex = vk->family,
                                   .queueCount = 1, .pQueuePriorities = &prio};
    VkDeviceCreateInfo dci = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, .queueCreateInfoCount = 1,
                              .pQueueCreateInfos = &qci, .enabledExtensionCount = vk->extension_count,
                              .ppEnabledExtensionNames = vk->extensions};
    r = vkCreateDevice(vk->physical_device, &dci, NULL, &vk->device);
    if (r != VK_SUCCESS) {
        vk->device = VK_NULL_HANDLE;
        FAIL("vkCreateDevice: %d", (int)r);
    }
    vkGetDeviceQueue(vk->device, vk->family, 0, &vk->queue);
    return 0;
fail:
    smoke_vk_close(vk);
    return -1;
}

int smoke_vk_read(struct smoke_vk *vk, uint64_t buffer, uint64_t offset, void *out, size_t len, char *why, size_t cap) {
    VkBuffer dst = VK_NULL_HANDLE;
    VkDeviceMemory mem = VK_NULL_HANDLE;
    VkCommandPool pool = VK_NULL_HANDLE;
    VkFence fence = VK_NULL_HANDLE;
    int rc = -1;
    VkResult r;
    VkBufferCreateInfo bci = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = len,
                              .usage = VK_BUFFER_USAGE_TRANSFER_DST_BIT, .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
    if ((r = vkCreateBuffer(vk->device, &bci, NULL, &dst)) != VK_SUCCESS) FAIL("vkCreateBuffer: %d", (int)r);
    VkMemoryRequirements req;
    vkGetBufferMemoryRequirements(vk->device, dst, &req);
    VkPhysicalDeviceMemoryProperties mp;
    vkGetPhysicalDeviceMemoryProperties(vk->physical_device, &mp);
    VkMemoryPropertyFlags want = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    uint32_t type = UINT32_MAX;
    for (uint32_t i = 0; i < mp.memoryTypeCount && type == UINT32_MAX; i++)
        if ((req.memoryTypeBits & (1u << i)) && (mp.memoryTypes[i].propertyFlags & want) == want) type = i;
    if (type == UINT32_MAX) FAIL("no host-visible coherent memory type");
    VkMemoryAllocateInfo mai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, .allocationSize = req.size,
                                .memoryTypeIndex = type};
    if ((r = vkAllocateMemory(vk->device, &mai, NULL, &mem)) != VK_SUCCESS) FAIL("vkAllocateMemory: %d", (int)r);
    if ((r = vkBindBufferMemory(vk->device, dst, mem, 0)) != VK_SUCCESS) FAIL("vkBindBufferMemory: %d", (int)r);
    VkCommandPoolCreateInfo pci = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, .queueFamilyIndex = vk->family};
    if ((r = vkCreateCommandPool(vk->device, &pci, NULL, &pool)) != VK_SUCCESS) FAIL("vkCreateCommandPool: %d", (int)r);
    VkCommandBufferAllocateInfo cai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, .commandPool = pool,
                                       .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY, .commandBufferCount = 1};
    VkCommandBuffer cmd;
    if ((r = vkAllocateCommandBuffers(vk->device, &cai, &cmd)) != VK_SUCCESS) FAIL("vkAllocateCommandBuffers: %d", (int)r);
    VkCommandBufferBeginInfo begin = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                      .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
    vkBeginCommandBuffer(cmd, &begin);
    VkBufferCopy region = {.srcOffset = offset, .dstOffset = 0, .size = len};
    vkCmdCopyBuffer(cmd, (VkBuffer)(uintptr_t)buffer, dst, 1, &region);
    VkMemoryBarrier barrier = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER, .srcAccessMask = VK_ACCESS_TRANSFER_WRITE_BIT,
                               .dstAccessMask = VK_ACCESS_HOST_READ_BIT};
    vkCmdPipelineBarrier(cmd, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_PIPELINE_STAGE_HOST_BIT, 0, 1, &barrier, 0, NULL, 0, NULL);
    if ((r = vkEndCommandBuffer(cmd)) != VK_SUCCESS) FAIL("vkEndCommandBuffer: %d", (int)r);
    VkFenceCreateInfo fci = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
    if ((r = vkCreateFence(vk->device, &fci, NULL, &fence)) != VK_SUCCESS) FAIL("vkCreateFence: %d", (int)r);
    VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .commandBufferCount = 1, .pCommandBuffers = &cmd};
    if ((r = vkQueueSubmit(vk->queue, 1, &si, fence)) != VK_SUCCESS) FAIL("vkQueueSubmit: %d", (int)r);
    if ((r = vkWaitForFences(vk->device, 1, &fence, VK_TRUE, UINT64_MAX)) != VK_SUCCESS) FAIL("vkWaitForFences: %d", (int)r);
    void *mapped;
    if ((r = vkMapMemory(vk->device, mem, 0, len, 0, &mapped)) != VK_SUCCESS) FAIL("vkMapMemory: %d", (int)r);
    memcpy(out, mapped, len);
    vkUnmapMemory(vk->device, mem);
    rc = 0;
fail:
    if (fence) vkDestroyFence(vk->device, fence, NULL);
    if (pool) vkDestroyCommandPool(vk->device, pool, NULL);
    if (dst) vkDestroyBuffer(vk->device, dst, NULL);
    if (mem) vkFreeMemory(vk->device, mem, NULL);
    return rc;
}

void smoke_vk_close(struct smoke_vk *vk) {
    if (vk->device) vkDestroyDevice(vk->device, NULL);
    if (vk->instance) vkDestroyInstance(vk->instance, NULL);
    memset(vk, 0, sizeof *vk);
}
