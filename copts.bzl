"""Compiler options shared by fsdpp's BUILD files."""

def kernel_opt():
    """-O3 for the hot CPU kernels, except in the sanitizer builds.

    --config=asan and --config=tsan (.bazelrc) define sanitizer=true and keep
    their -O1: at -O3 the Highway kernels, compiled once per SIMD target, took
    about three minutes each under ASan + UBSan. The kernels compute the same
    bits at either level (no -ffast-math; contraction is set per target).
    """
    return select({
        "@fsdpp//:sanitizer": [],
        "//conditions:default": ["-O3"],
    })
