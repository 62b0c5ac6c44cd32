"""Compiler options shared by fsdpp's BUILD files."""

def kernel_opt():
    """-O3 for the hot CPU kernels, except in the sanitizer builds.

    --config=asan and --config=tsan (.bazelrc) define sanitizer=true and keep
    their -O1: at -O3 the Highway kernels compile once per SIMD target, and
    tensor/cpu/attention.cc alone took 186 s under ASan + UBSan (107 s at -O1). The kernels compute the same
    bits at either level (no -ffast-math; contraction is set per target).
    """
    return select({
        "@fsdpp//:sanitizer": [],
        "//conditions:default": ["-O3"],
    })
