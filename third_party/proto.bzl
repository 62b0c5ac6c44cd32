"""cc_proto: C++ code from .proto files with the system protoc.

Bazel's native cc_proto_library needs @com_google_protobuf (a download); this
macro runs Debian's /usr/bin/protoc in a genrule instead and wraps the output
in a cc_library that links the system libprotobuf, so the generated code always
matches the installed runtime.
"""

def cc_proto(name, srcs, deps = [], visibility = None):
    """Generates <name> (cc_library) from srcs (.proto, paths from the repo root).

    Args:
      name: target name.
      srcs: .proto files in this package.
      deps: other cc_proto targets whose .proto files these import.
      visibility: as for cc_library.
    """
    pkg = native.package_name()

    # From another workspace (fsdpp as @fsdpp) the sources are under
    # external/<repo>/ and the outputs must go to the same place under
    # $(GENDIR), so that the generated code's "pkg/x.pb.h" includes resolve.
    repo = native.repository_name()
    root = "" if repo == "@" else "external/" + repo[1:]
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs.extend([base + ".pb.h", base + ".pb.cc"])
    paths = ["/".join([p for p in [root, pkg, s] if p]) for s in srcs]
    native.genrule(
        name = name + "_gen",
        srcs = srcs + [d + "_srcs" for d in deps],
        outs = outs,
        cmd = "/usr/bin/protoc --proto_path={} --cpp_out=$(GENDIR){} {}".format(
            root or ".",
            "/" + root if root else "",
            " ".join(paths),
        ),
        message = "protoc " + name,
    )
    native.filegroup(
        name = name + "_srcs",
        srcs = srcs + [d + "_srcs" for d in deps],
        visibility = visibility,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["@protobuf"],
        visibility = visibility,
    )
