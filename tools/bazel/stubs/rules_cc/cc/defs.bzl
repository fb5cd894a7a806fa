"""Offline stand-in for rules_cc under Bazel 4.2.3: forwards to the native rules."""
cc_binary = native.cc_binary
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_import = native.cc_import
cc_toolchain_suite = native.cc_toolchain_suite
cc_proto_library = native.cc_proto_library
objc_library = native.objc_library
objc_import = native.objc_import
fdo_profile = native.fdo_profile
fdo_prefetch_hints = native.fdo_prefetch_hints
