#!/usr/bin/env python3
"""Compile CUDA sources to PTX with NVRTC through ctypes (no nvcc, no driver needed).

usage: nvrtc_compile.py --nvrtc LIB --arch compute_90 -I DIR [-I DIR ...] --out-dir DIR SRC.cu [...]

Writes DIR/<stem>.ptx for each source, prints the program log (warnings included) and exits
non-zero on the first failed compile. This mirrors what the worker does at start, so a source
that passes here compiles the same way in production (same option list).
"""
import argparse
import ctypes
import pathlib
import sys

NVRTC_SUCCESS = 0


def check(lib, rc, what):
    if rc != NVRTC_SUCCESS:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def compile_one(lib, src: pathlib.Path, arch: str, includes, extra):
    prog = ctypes.c_void_p()
    code = src.read_bytes()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), code, str(src.name).encode(), 0, None, None),
          "nvrtcCreateProgram")
    # Same options the worker passes at start (docs/kernels.md): no fast-math, so expf/sincosf
    # keep full precision; FMA contraction is on (the CPU reference tolerates it).
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--fmad=true"]
    opts += [f"--include-path={d}" for d in includes]
    opts += extra
    c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
    log_size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
    log = ctypes.create_string_buffer(log_size.value)
    lib.nvrtcGetProgramLog(prog, log)
    log_text = log.value.decode(errors="replace").strip()
    if rc != NVRTC_SUCCESS:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return None, log_text
    size = ctypes.c_size_t()
    check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
    buf = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.value, log_text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", required=True, help="path to libnvrtc.so")
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("-I", dest="includes", action="append", default=[])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--opt", action="append", default=[], help="extra NVRTC option")
    ap.add_argument("sources", nargs="+")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.nvrtc)
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s in a.sources:
        src = pathlib.Path(s)
        ptx, log = compile_one(lib, src, a.arch, a.includes, a.opt)
        if ptx is None:
            print(f"nvrtc: {src.name}: FAILED\n{log}", file=sys.stderr)
            return 1
        (out / f"{src.stem}.ptx").write_bytes(ptx)
        if log:
            # Any diagnostic counts: the check treats warnings as errors.
            print(f"nvrtc: {src.name}: diagnostics\n{log}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
