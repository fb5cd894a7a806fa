{
  description = "Hermetic reproducibility bundle for training recipes: DeepSeek-V4-Flash on 64 H200 (miles + Megatron-LM)";

  # No inputs: `nix run .#train` evaluates and runs offline. Outputs that need nixpkgs (CUDA, NCCL builds)
  # are not part of this flake; see README.md.
  outputs = { self }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);
      revision = self.rev or "dirty";
      # A tiny wrapper inside a derivation (Nix 2.8 cannot run a program given as "${self}/bin/x" directly):
      # it records the flake's revision and runs bin/train from the flake's source in the store.
      wrapper = system: name: builtins.derivation {
        inherit system;
        name = "recipe-bundle-${name}";
        builder = "/bin/sh";
        args = [ "-c" ''
          /bin/mkdir -p "$out/bin"
          /bin/printf '#!/bin/sh\nexport TRAINER_SOURCE_REVISION=%s\nexec %s "$@"\n' '${revision}' '${self}/bin/${name}' > "$out/bin/${name}"
          /bin/chmod 0555 "$out/bin/${name}"
        '' ];
      };
      app = system: name: { type = "app"; program = "${wrapper system name}/bin/${name}"; };
    in
    {
      apps = forAllSystems (system: {
        train = app system "train";
        trainer = app system "trainer";
        default = app system "train";
      });

      # The stack pins, for other flakes and for `nix eval .#lib.pins`.
      lib.pins = (builtins.fromJSON (builtins.readFile ./lockfiles/stack.json)).components;
    };
}
