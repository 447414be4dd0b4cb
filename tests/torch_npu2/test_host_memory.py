"""Freed host memory goes back to the OS: the heap keeps what a process frees below a live block, and
release_free_heap returns it."""
import json
import subprocess
import sys

import pytest

PROBE = """
import json, torch
from torch_npu2.host_memory import release_free_heap

rss = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
large = torch.ones(16 << 20, dtype=torch.uint8)
del large  # glibc raises its mmap threshold to the size of a large block freed: what a model's load does
blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(128)]  # 128 MiB, now in the heap
above = torch.ones(1 << 20, dtype=torch.uint8)  # a live block above them: the heap cannot shrink
held = rss()
del blocks
freed = rss()
released = release_free_heap()
print(json.dumps([held, freed, rss(), released]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc/self (Linux)")
def test_release_free_heap_returns_what_the_heap_keeps():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    held, freed, released_rss, released = json.loads(done.stdout.strip().splitlines()[-1])
    if not released:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    mib = 1 << 20
    assert freed > held - 16 * mib, (held, freed)  # freeing alone leaves the pages in the process
    assert released_rss < freed - 100 * mib, (freed, released_rss)
