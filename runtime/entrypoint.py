"""The container image's entrypoint (``deploy/Containerfile``): ``python -m runtime.entrypoint serve …``.

Before ``toolcell serve`` it does what a container needs and a host does not:

1. moves itself into the ``daemon`` leaf of its cgroup when that cgroup is a delegated cgroup v2
   (``sandbox.isolation.cgroups.enter_daemon_leaf``), so that workers' cgroups can go beside it;
2. runs ``toolcell doctor`` and prints its table, so the log says which isolation layers this
   container has and, for each missing one, why and what engine option fixes it;
3. refuses to start (exit 78, EX_CONFIG) when the policy is ``strict`` and the doctor says strict
   cannot run here, instead of serving a catalog whose every call would be refused.

Then it execs ``toolcell`` with the same arguments, in the same process (pid 1 stays the daemon,
which gets the engine's SIGTERM itself). Any other command (``doctor``, ``list``, ``call``) is
exec'd directly.
"""

from __future__ import annotations

import os
import sys

from runtime import doctor
from runtime.config import ConfigError, load_config
from sandbox.isolation import cgroups

#: sysexits.h EX_CONFIG: the container's configuration (its engine options) is what must change.
EXIT_CANNOT_ISOLATE = 78


def policy_of(args: list[str]) -> str | None:
    """The policy ``toolcell serve ARGS`` will run under: ``--policy``, else the config file's, else
    the default; None when the config cannot be read (``serve`` then reports it)."""
    overrides: dict[str, str | None] = {"policy": None}
    config: str | None = None
    for i, arg in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else None
        if arg == "--policy":
            overrides["policy"] = value
        elif arg.startswith("--policy="):
            overrides["policy"] = arg.split("=", 1)[1]
        elif arg == "--config":
            config = value
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    try:
        return load_config(config, overrides).policy
    except ConfigError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        leaf = cgroups.enter_daemon_leaf()
        if leaf is not None:
            print(f"toolcell: running in {leaf}; workers' cgroups go beside it", file=sys.stderr)
        try:
            text, strict_ok = doctor.render(doctor.run_probe())
        except RuntimeError as exc:
            text, strict_ok = f"toolcell doctor: {exc}", False
        print(text, file=sys.stderr, flush=True)
        if not strict_ok and policy_of(args[1:]) == "strict":
            print("toolcell: refusing to start: the strict policy needs every isolation layer and this container "
                  "lacks some (see the table above for why and the option that fixes each). Run the container "
                  "with those options, or choose policy = \"compat\" knowingly.", file=sys.stderr, flush=True)
            return EXIT_CANNOT_ISOLATE
    os.execv(sys.executable, [sys.executable, "-m", "runtime.cli", *args])
    return 0  # not reached: execv replaces the process


if __name__ == "__main__":
    raise SystemExit(main())
