#!/usr/bin/env python3
"""Summarize a `prism bench --host-profile FILE` sample file.

Each sample is the instruction a thread was interrupted at after about a millisecond of process CPU time
(the kernel's timer tick may make it coarser: count shares, not milliseconds), and with a binary built
with frame pointers (RUSTFLAGS="-C force-frame-pointers=yes") the return addresses above it. The
samples of the binary itself are named from BINARY, the unstripped build the profiled (stripped) copy was
made from (`nm`, `readelf`); samples in shared libraries (the CUDA driver, libc, ...) are counted by
library. Per tag (a scenario, or a thought batch size): the share of each module, then the functions of
the binary that took the most samples.

Usage: host_profile.py FILE BINARY [TOP] [--module NAME]   (NAME: the binary's file name in the map,
default the basename of the profiled executable, i.e. `prism`)
"""
import bisect
import collections
import os
import re
import subprocess
import sys


def read(path):
    tags, maps, samples = {}, [], []
    with open(path) as f:
        for line in f:
            if line.startswith("tag "):
                _, i, name = line.rstrip("\n").split(" ", 2)
                tags[int(i)] = name
            elif line.startswith("map "):
                parts = line[4:].split(None, 5)
                start, end = (int(x, 16) for x in parts[0].split("-"))
                offset = int(parts[2], 16)
                name = parts[5].strip() if len(parts) > 5 else ""
                maps.append((start, end, offset, name))
            elif line.startswith("s "):
                f = line.split()
                samples.append((int(f[1]), int(f[2]), [int(a, 16) for a in f[3:]]))
    maps.sort()
    return tags, maps, samples


def load_segments(binary):
    """(p_offset, p_vaddr, p_filesz) of the LOAD segments."""
    out = subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True, check=True).stdout
    segs = []
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "LOAD":
            segs.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
    return segs


def symbols(binary):
    out = subprocess.run(["nm", "-C", "--defined-only", "--numeric-sort", binary], capture_output=True,
                         text=True, check=True).stdout
    addrs, names = [], []
    for line in out.splitlines():
        f = line.split(" ", 2)
        if len(f) == 3 and f[1].lower() in ("t", "w"):
            addrs.append(int(f[0], 16))
            names.append(re.sub(r"::h[0-9a-f]{16}$", "", f[2]))
    return addrs, names


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    module = "prism"
    if "--module" in sys.argv:
        module = sys.argv[sys.argv.index("--module") + 1]
        args = [a for a in args if a != module]
    if len(args) < 2:
        sys.exit(__doc__)
    path, binary = args[0], args[1]
    top = int(args[2]) if len(args) > 2 else 25
    tags, maps, samples = read(path)
    starts = [m[0] for m in maps]
    segs = load_segments(binary)
    addrs, names = symbols(binary)

    def locate(ip):
        i = bisect.bisect_right(starts, ip) - 1
        if i < 0 or ip >= maps[i][1]:
            return "?", None
        start, _, offset, name = maps[i]
        base = os.path.basename(name) or "[anonymous]"
        if base != module:
            return base, None
        off = ip - start + offset
        for p_off, p_vaddr, p_size in segs:
            if p_off <= off < p_off + p_size:
                vaddr = off - p_off + p_vaddr
                j = bisect.bisect_right(addrs, vaddr) - 1
                return base, names[j] if j >= 0 else "?"
        return base, "?"

    by_tag = collections.defaultdict(list)
    for tag, tid, stack in samples:
        by_tag[tag].append((tid, stack))
    for tag in sorted(by_tag):
        rows = by_tag[tag]
        mods, leaf, caller, inclusive, threads = (collections.Counter() for _ in range(5))
        deep = 0
        for tid, stack in rows:
            threads[tid] += 1
            # Return addresses point after their call: look up the call itself.
            located = [locate(a if i == 0 else a - 1) for i, a in enumerate(stack)]
            mods[located[0][0]] += 1
            if located[0][1] is not None:
                leaf[located[0][1]] += 1
            funcs = [f for _, f in located if f is not None]
            if funcs:
                caller[funcs[0]] += 1
            if len(stack) > 1:
                deep += 1
            for f in set(funcs):
                inclusive[f] += 1
        n = len(rows)
        print(f"\n== {tags.get(tag, tag)}: {n} samples, {len(threads)} threads "
              f"(busiest {threads.most_common(1)[0][1]} samples), {deep} with call stacks")
        for mod, c in mods.most_common(8):
            print(f"  {100 * c / n:5.1f} %  {mod}")
        for title, counter in (
            (f"where the time is (functions of {module})", leaf),
            (f"innermost function of {module} on the stack (a library's time charged to its caller)", caller),
            ("on the stack at all (inclusive; needs frame pointers)", inclusive),
        ):
            print(f"  {title}:")
            for func, c in counter.most_common(top):
                print(f"  {100 * c / n:5.1f} %  {func[:150]}")


if __name__ == "__main__":
    main()
