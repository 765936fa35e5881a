"""CI gate: the environment CI built is the pinned one, and its SBOM describes it.

    python .ci/check_env.py --constraints constraints.txt --sbom .ci-out/sbom.json

Run with the CI environment's python. Fails (exit 1, every problem listed) when
  - an installed distribution (other than rtxmpi, pip, setuptools, wheel) is not pinned in
    constraints.txt, or is installed at another version than its pin (a new dependency added to
    pyproject.toml without running .ci/lock);
  - the SBOM is not CycloneDX JSON with components, or misses an installed distribution.
"""
import argparse
import json
import re
import sys
from importlib import metadata

SKIP = {"rtxmpi", "pip", "setuptools", "wheel"}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path):
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, _, version = line.partition("==")
                pins[norm(name)] = version
    return pins


def installed():
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and norm(name) not in SKIP:
            found[norm(name)] = dist.version
    return found


def check_pins(pins, dists):
    problems = []
    for name, version in sorted(dists.items()):
        if name not in pins:
            problems.append(f"{name}=={version} is installed but not pinned in constraints.txt "
                            f"(run .ci/lock)")
        elif pins[name] != version:
            problems.append(f"{name}: installed {version}, constraints.txt pins {pins[name]}")
    return problems


def check_sbom(path, dists):
    try:
        with open(path) as f:
            bom = json.load(f)
    except (OSError, ValueError) as exc:
        return [f"{path}: not readable JSON: {exc}"]
    if bom.get("bomFormat") != "CycloneDX" or not bom.get("specVersion"):
        return [f"{path}: not a CycloneDX BOM (bomFormat {bom.get('bomFormat')!r})"]
    components = {(norm(c.get("name", "")), c.get("version")) for c in bom.get("components", [])}
    if not components:
        return [f"{path}: no components"]
    return [f"{path}: {name}=={version} is installed but not in the SBOM"
            for name, version in sorted(dists.items()) if (name, version) not in components]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--constraints", required=True)
    p.add_argument("--sbom", required=True)
    args = p.parse_args()
    dists = installed()
    problems = check_pins(read_pins(args.constraints), dists) + check_sbom(args.sbom, dists)
    if problems:
        print("environment gate FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"environment gate ok: {len(dists)} distributions, all pinned in {args.constraints} "
          f"and listed in {args.sbom}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
