"""Offline stand-in for rules_java under Bazel 4.2.3: forwards to the native rules."""
java_binary = native.java_binary
java_library = native.java_library
java_test = native.java_test
java_import = native.java_import
java_toolchain = native.java_toolchain
java_runtime = native.java_runtime
