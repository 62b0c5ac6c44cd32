"""cuda_library: compiles .cu files with nvcc and wraps them as a cc_library.

The objects are built by a small rule that takes the include paths, defines
and headers of its C++ deps from their CcInfo, so a .cu file includes headers
from the repository root exactly like a .cc file does. Targets are compatible
only with --config=cuda (define cuda=true): a plain CPU `bazel build //...`
skips them and never needs the toolkit.
"""

load("@local_cuda//:defs.bzl", "CUDA_PATH", "HAS_CUDA")

# Real GPUs we target (Ampere, Hopper) plus PTX for anything newer.
_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

def _cuda_objects_impl(ctx):
    if not HAS_CUDA:
        fail("--config=cuda needs the CUDA toolkit: set CUDA_PATH or install it under /usr/local/cuda")
    nvcc = CUDA_PATH + "/bin/nvcc"
    headers = []
    includes = []
    defines = []
    for dep in ctx.attr.deps:
        cc = dep[CcInfo].compilation_context
        headers.append(cc.headers)
        includes.extend(["-I" + p for p in cc.includes.to_list()])
        includes.extend(["-I" + p for p in cc.quote_includes.to_list()])
        includes.extend(["--system-include=" + p for p in cc.system_includes.to_list()])
        defines.extend(["-D" + d for d in cc.defines.to_list()])
    inputs = depset(ctx.files.srcs + ctx.files.hdrs, transitive = headers)
    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_objs/{}/{}.pic.o".format(ctx.label.name, src.basename[:-len(".cu")]))
        args = ctx.actions.args()
        args.add_all([
            "-std=c++17",
            "-O3",
            "-ccbin=/usr/bin/g++",
            "-Xcompiler=-fPIC",
            "--expt-relaxed-constexpr",
            "-Werror=all-warnings",
            "-I.",
            "-I" + ctx.bin_dir.path,
            "-DFSDPP_WITH_CUDA=1",
        ])
        args.add_all(_GENCODE)
        args.add_all(includes)
        args.add_all(defines)
        args.add_all(ctx.attr.copts)
        args.add_all(["-c", src.path, "-o", obj.path])
        ctx.actions.run(
            executable = nvcc,
            arguments = [args],
            inputs = inputs,
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "nvcc {}".format(src.short_path),
            use_default_shell_env = True,
        )
        objects.append(obj)
    return [DefaultInfo(files = depset(objects))]

_cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".h", ".cuh"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
    },
)

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], visibility = None, **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc (only under --config=cuda).

    Args:
      name: target name.
      srcs: .cu files.
      hdrs: public headers (plain C++ so .cc code may include them).
      deps: cc_library dependencies (their headers are visible to nvcc).
      copts: extra nvcc flags.
      visibility: as for cc_library.
      **kwargs: passed to cc_library.
    """
    compat = select({
        "@fsdpp//:cuda_enabled": [],
        "//conditions:default": ["@fsdpp//:never_without_cuda"],
    })
    _cuda_objects(
        name = name + "_objs",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:headers"],
        copts = copts,
        target_compatible_with = compat,
    )
    native.cc_library(
        name = name,
        srcs = [":" + name + "_objs"],
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        target_compatible_with = compat,
        visibility = visibility,
        **kwargs
    )

def cuda_only():
    """target_compatible_with value for plain cc_* targets that need CUDA."""
    return select({
        "@fsdpp//:cuda_enabled": [],
        "//conditions:default": ["@fsdpp//:never_without_cuda"],
    })
