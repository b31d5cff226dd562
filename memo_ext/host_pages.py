"""What one page-locked host buffer costs: MEMO's offload slots on CUDA
(memo_ext.device, ``CopyEngine.alloc_host``) are mapped at their own size and page-locked with
``cudaHostRegister``, which locks whole pages, so a slot of n bytes holds n rounded up to the
page. Shared by the runtime's LP (memo_ext.offload.alpha) and the estimator's host model
(memo_ext.estimate.host_memory); it imports nothing, so the estimator stays free of torch and
megatron."""

#: The base page of x86-64 Linux, the GPU nodes modelled here. A kernel with larger pages
#: (64 KiB on some aarch64 systems) rounds each slot to its own page instead: under 64 KiB more
#: per slot, against slots of hundreds of MiB or more.
HOST_PAGE_BYTES = 4096


def page_locked_bytes(nbytes: int) -> int:
    """Host bytes a buffer of ``nbytes`` takes once page-locked: whole pages (0 for 0)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return -(-int(nbytes) // HOST_PAGE_BYTES) * HOST_PAGE_BYTES


__all__ = ["HOST_PAGE_BYTES", "page_locked_bytes"]
