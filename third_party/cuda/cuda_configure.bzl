"""Repository rule that finds the CUDA toolkit for --config=cuda.

Looks at $CUDA_PATH, then /usr/local/cuda. When a toolkit with bin/nvcc is
found, @local_cuda exposes cudart, cuBLASLt, NCCL and cuDNN as cc_library
targets and defs.bzl records CUDA_PATH. When none is found the repository
still exists (so the CPU build, which never references it, is unaffected) and
a --config=cuda build fails with a message saying that the toolkit is missing.
"""

_CUDA_LIB_BUILD = """
cc_library(
    name = "{name}",
    deps = [":headers"],
    linkopts = ["-L{path}/lib64", "-Wl,-rpath,{path}/lib64", {libs}],
)
"""

def _cuda_configure_impl(ctx):
    cuda_path = ctx.os.environ.get("CUDA_PATH", "") or "/usr/local/cuda"
    found = ctx.path(cuda_path + "/bin/nvcc").exists
    build = ['package(default_visibility = ["//visibility:public"])']
    if found:
        ctx.symlink(cuda_path + "/include", "include")
        build.append("""
cc_library(
    name = "headers",
    # Everything: libcu++ headers such as <nv/target> have no extension.
    hdrs = glob(["include/**"]),
    includes = ["include"],
)
""")
        for name, libs in [
            ("cudart", '"-lcudart"'),
            ("cublaslt", '"-lcublasLt"'),
            ("nccl", '"-lnccl"'),
            ("cudnn", '"-lcudnn"'),
        ]:
            build.append(_CUDA_LIB_BUILD.format(name = name, path = cuda_path, libs = libs))
    else:
        for name in ["headers", "cudart", "cublaslt", "nccl", "cudnn"]:
            build.append('cc_library(name = "{}")'.format(name))
    ctx.file("BUILD", "\n".join(build))
    ctx.file("defs.bzl", "CUDA_PATH = {}\nHAS_CUDA = {}\n".format(
        repr(cuda_path if found else ""),
        "True" if found else "False",
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
