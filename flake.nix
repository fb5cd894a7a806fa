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
        image = app system "image";
        default = app system "train";
      });

      # The stack pins, for other flakes and for `nix eval .#lib.pins`.
      lib.pins = (builtins.fromJSON (builtins.readFile ./lockfiles/stack.json)).components;

      # Every image lock in lockfiles/ (NAME.lock.json -> lib.locks.NAME), read from the same files the builder
      # reads: `nix eval .#lib.locks.smoke.wheels`. lib.wheels.NAME lists "name==version sha256" per wheel.
      lib.locks =
        let
          files = builtins.attrNames (builtins.readDir ./lockfiles);
          locks = builtins.filter (f: builtins.match ".*\\.lock\\.json" f != null) files;
        in
        builtins.listToAttrs (map (f: {
          name = builtins.head (builtins.match "(.*)\\.lock\\.json" f);
          value = builtins.fromJSON (builtins.readFile (./lockfiles + "/${f}"));
        }) locks);
      lib.wheels = builtins.mapAttrs (_: lock: map (w: "${w.name}==${w.version} ${w.sha256}") lock.wheels) self.lib.locks;
    };
}
