"""Offline shim for @rules_cc: re-exports Bazel's native C++ rules.

Debian's bazel-bootstrap cannot download rules_cc; its own @bazel_tools loads
these names from @rules_cc//cc:defs.bzl, so this file provides them.
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_shared_library = getattr(native, "cc_shared_library", None)
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_import = native.objc_import
objc_library = native.objc_library
