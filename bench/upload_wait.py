"""Whether a non-blocking host-to-device copy from pageable memory returns at once or waits for the work queued
before it, by size (why runtime/host.upload pins copies above PINNED_ABOVE): each copy is queued behind ~0.1 s
of GPU work (torch.cuda._sleep); "stream still busy" after it returns means it did not wait. Development only.

    python3 bench/upload_wait.py     (results/upload-wait-h200.log)
"""
import time

import torch


def main():
    for n in (1 << 12, 1 << 14, 1 << 15, 46080, 1 << 17, 1 << 20):  # int64 elements: 32 KB .. 8 MB
        src = torch.arange(n)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        t = time.perf_counter()
        src.to("cuda", non_blocking=True)
        dt = (time.perf_counter() - t) * 1e3
        busy = not torch.cuda.current_stream().query()
        print(f"pageable {n * 8 // 1024} KB: returned in {dt:.2f} ms, stream still busy: {busy}")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
