"""What verifying the default model's cache costs, against loading the model (genspec/embedded.py).

    python benchmarks/costs/cache_verify_cost.py > benchmarks/results/costs/cache_verify_cost.md

Times the sha256 of each cached file, the check made on every load (sizes, safetensors header, sha256
of the files up to HASH_ON_EVERY_LOAD_BYTES), the check after the weights' modification time changed
(their full sha256), and ``genspec.load_model(backend="torch")``. Medians of a few repeats, files in the page cache.
"""
from __future__ import annotations

import os
import platform

from timing import median_seconds

import genspec
from genspec import embedded



def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    directory = embedded.default_model_dir()  # converts on first use, records checksums of an older cache
    print(f"# Cost of verifying the default model's cache\n\n`python benchmarks/costs/cache_verify_cost.py` on "
          f"{cpu_name()}, {os.cpu_count()} cores shared with other work; "
          f"cache {directory}; medians.\n")
    print("| what | seconds |\n|---|---|")
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.stat().st_size > 1_000_000:
            seconds = median_seconds(lambda: embedded._sha256(path), 3, warmup=0)
            print(f"| sha256 of {path.name} ({path.stat().st_size / 1e6:,.0f} MB) | {seconds:.3f} |")
    seconds = median_seconds(lambda: embedded.verify_cache(directory), 5, warmup=0)
    print(f"| check on every load (sizes, header, sha256 of files <= "
          f"{embedded.HASH_ON_EVERY_LOAD_BYTES >> 20} MiB) | {seconds:.3f} |")
    weights = directory / "model.safetensors"
    stat = weights.stat()

    def check_after_touch():
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
        try:
            assert embedded.verify_cache(directory).usable
        finally:
            os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    print(f"| check after the weights' modification time changed (full sha256) | "
          f"{median_seconds(check_after_touch, 3, warmup=0):.3f} |")
    print(f"| genspec.load_model(backend='torch') (verification included) | {median_seconds(lambda: genspec.load_model(backend='torch'), 3, warmup=0):.3f} |")


if __name__ == "__main__":
    main()
