"""Offline stand-in for rules_cc under Bazel 4.2.3: forwards to the native rules."""
cc_binary = native.cc_binary
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_import = native.cc_import
