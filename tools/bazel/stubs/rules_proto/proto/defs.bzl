"""Offline stand-in for rules_proto under Bazel 4.2.3: forwards to the native rules."""
proto_library = native.proto_library
proto_lang_toolchain = native.proto_lang_toolchain
