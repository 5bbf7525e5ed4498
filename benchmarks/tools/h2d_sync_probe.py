"""Whether a ``non_blocking`` host-to-device copy waits for the GPU work queued before it, from pageable and from
pinned memory, behind a sleep kernel (``xattn.torch.split_kv.int32_lists`` copies a new cache length's cu_seqlens
this way). GPU machine::

    python benchmarks/tools/h2d_sync_probe.py
"""
import time

import torch


def main() -> None:
    x = torch.tensor(list(range(80)), dtype=torch.int32)
    for label, src in (("pageable", x), ("pinned", x.pin_memory())):
        src.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of queued GPU work
        t0 = time.perf_counter()
        src.to("cuda", non_blocking=True)
        copy = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        rest = time.perf_counter() - t0
        print(f"{label}: the copy held the host {copy * 1e3:.2f} ms; {rest * 1e3:.2f} ms of queued work left after it")


if __name__ == "__main__":
    main()
