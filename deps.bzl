"""fsdpp_dependencies(): the external repositories fsdpp's BUILD files use.

fsdpp's own WORKSPACE calls it, and so does another Bazel project that uses
fsdpp's libraries:

    local_repository(name = "fsdpp", path = "path/to/fsdpp")
    load("@fsdpp//:deps.bzl", "fsdpp_dependencies")
    fsdpp_dependencies(fsdpp_path = "path/to/fsdpp")

Everything is offline: Bazel's own rules_cc / rules_java /
remote_coverage_tools come from shims in third_party/ (Bazel 4.2.3 would
otherwise download them), the libraries from Debian's packages under /usr
(tools/setup.sh installs them), and the CUDA toolkit from $CUDA_PATH or
/usr/local/cuda when present. A repository the caller already defined is
left alone, so a consumer can bring its own.
"""

load("//third_party/cuda:cuda_configure.bzl", "cuda_configure")

# Debian system libraries wrapped by third_party/<name>.BUILD.
_SYSTEM_LIBRARIES = [
    "absl",
    "protobuf",
    "gtest",
    "benchmark",
    "dnnl",
    "gloo",
    "hwy",
]

# Offline shims for repositories @bazel_tools refers to.
_SHIMS = ["rules_cc", "rules_java", "remote_coverage_tools"]

def fsdpp_dependencies(fsdpp_path = "."):
    """Defines fsdpp's external repositories.

    Args:
      fsdpp_path: fsdpp's directory, relative to the calling workspace's
        root (the `path` of its local_repository), or absolute; "." for
        fsdpp itself.
    """
    existing = native.existing_rules()
    for name in _SHIMS:
        if name not in existing:
            native.local_repository(
                name = name,
                path = fsdpp_path + "/third_party/" + name,
            )
    for name in _SYSTEM_LIBRARIES:
        if name not in existing:
            native.new_local_repository(
                name = name,
                build_file = str(Label("//third_party:%s.BUILD" % name)),
                path = "/usr",
            )
    if "local_cuda" not in existing:
        cuda_configure(name = "local_cuda")
