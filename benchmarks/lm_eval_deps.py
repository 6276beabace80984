"""Whether lm-eval and everything it needs will be on the GPU machine (H200, Python 3.12, no internet).

The H200 image has no lm-eval; benchmarks/lm_eval_wheels.sh carries it as wheels under .whl/lm_eval/ and
benchmarks/gpu_tasks.sh installs them there. This walks lm-eval's requirements (Requires-Dist with the
markers evaluated for CPython 3.12 on x86-64 Linux, extras followed: ``typepy[datetime]``, ...) and says
for each package where it comes from:

    python3 benchmarks/lm_eval_deps.py wheels .whl/lm_eval   # here: every requirement is a carried wheel
                                                            # (version checked) or in the image's list
    python3 benchmarks/lm_eval_deps.py installed            # there: every requirement installed, in a
                                                            # version that satisfies it
    python3 benchmarks/lm_eval_deps.py simulate DIR         # here: DIR gets links to this machine's copies
                                                            # of the image's packages (an import check)

``IMAGE`` is the H200 image's package list (as the device documentation lists it, read 2026-11-17), with
the versions where they are known. A carried wheel is checked against every specifier that names it; an
image package only where its version is known, so ``wheels`` reports the others as unverified rather than
fine. Exit status 1 on a missing package or a version that does not satisfy a requirement.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = "lm-eval"
# the H200 image's Python packages (the "cuda" image as the device documentation lists it, read 2026-11-17),
# with the versions a pip list there showed
IMAGE_NAMES = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
    equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
    grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
    interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
    lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
IMAGE_VERSIONS = {"huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                  "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0"}
IMAGE = {name: IMAGE_VERSIONS.get(name) for name in IMAGE_NAMES}
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(requires: list[str], extras: set[str]) -> list[Requirement]:
    """The Requires-Dist entries that apply on the GPU machine with these extras asked for."""
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**ENVIRONMENT, "extra": e})
                                     for e in ("", *extras)):
            out.append(req)
    return out


def wheel_metadata(folder: Path) -> dict[str, tuple[str, list[str], str]]:
    """{name: (version, Requires-Dist lines, wheel file)} of the wheels in a folder."""
    found = {}
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(archive.read(name).decode("utf-8"))
        key = canonical(meta["Name"])
        if key in found:
            raise SystemExit(f"two wheels of {key}: {found[key][2]} and {wheel.name} (keep one)")
        found[key] = (meta["Version"], meta.get_all("Requires-Dist") or [], wheel.name)
    return found


def installed(name: str) -> tuple[str, list[str]] | None:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return dist.version, dist.requires or []


def walk(lookup, follow) -> dict[str, dict]:
    """{package: {"specs": [(by, specifier)], "version", "source"}} from lm-eval down. lookup(name) gives
    (version, requires, source) or None; follow(name, source) says whether to walk into its requirements."""
    seen: dict[str, dict] = {}
    todo = [(ROOT, set(), "", "")]
    expanded: set[tuple[str, frozenset]] = set()
    while todo:
        name, extras, by, spec = todo.pop()
        key = canonical(name)
        entry = seen.get(key)
        if entry is None:
            found = lookup(key)
            entry = seen[key] = {"specs": [], "version": found and found[0], "source": found and found[2],
                                 "requires": found[1] if found else []}
        if by and (by, spec) not in entry["specs"]:
            entry["specs"].append((by, spec))
        done = (key, frozenset(extras))
        if entry["source"] is None or not follow(key, entry["source"]) or done in expanded:
            continue
        expanded.add(done)
        for req in requirements(entry["requires"], extras):
            todo.append((req.name, set(req.extras), key, str(req.specifier)))
    return seen


def report(seen: dict[str, dict]) -> int:
    """One line per package; 1 if one is missing or does not satisfy a specifier."""
    bad = 0
    for key in sorted(seen):
        entry = seen[key]
        specs = [(by, s) for by, s in entry["specs"] if s]
        version = entry["version"]
        if entry["source"] is None:
            status, bad = "MISSING", bad + 1
        elif version is None:
            status = "unverified (version not known here)" if specs else "ok"
        else:
            failing = [f"{by} wants {s}" for by, s in specs
                       if not Requirement(f"x{s}").specifier.contains(Version(version), prereleases=True)]
            status = "CONFLICT: " + "; ".join(failing) if failing else "ok"
            bad += bool(failing)
        wanted = ", ".join(f"{s} ({by})" for by, s in specs) or "any"
        print(f"{key:22s} {version or '?':14s} {entry['source']!s:44s} {status}  [wants {wanted}]")
    return int(bad > 0)


def check_wheels(folder: Path) -> int:
    wheels = wheel_metadata(folder)
    carried = {k: (v, req, f"wheel {f}") for k, (v, req, f) in wheels.items()}

    def lookup(key):
        if key in carried:
            return carried[key]
        if key in IMAGE:
            return IMAGE[key], [], "image"
        return None

    seen = walk(lookup, lambda key, source: source != "image")
    status = report(seen)
    unused = sorted(set(carried) - set(seen))
    if unused:
        print(f"carried but not required: {', '.join(unused)}")
    total = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{len(carried)} wheels, {total / 2**20:.2f} MiB in {folder}")
    return status


def check_installed() -> int:
    def lookup(key):
        found = installed(key)
        if found is None:
            return None
        where = Path(str(metadata.distribution(key).locate_file("")))
        return found[0], found[1], "/".join(where.parts[-2:])  # e.g. tmp/site (carried), or site-packages

    return report(walk(lookup, lambda key, source: True))


def simulate(folder: Path) -> int:
    """Link this machine's copy of every image package (and its dist-info) into folder, skipping names
    folder already holds (installed there to pin an image version, e.g. huggingface-hub 1.33)."""
    folder.mkdir(parents=True, exist_ok=True)
    present = {canonical(p.name.split("-")[0]) for p in folder.glob("*.dist-info")}
    linked, absent = [], []
    for key in IMAGE:
        if key in present:
            continue
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            absent.append(key)
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            source = Path(str(dist.locate_file(top)))
            target = folder / top
            if source.exists() and not target.exists() and not top.endswith(".pth") and top != "__pycache__":
                target.symlink_to(source)
        linked.append(f"{key} {dist.version}")
    print(f"simulate: linked {len(linked)} packages of this machine into {folder}; not installed here, so "
          f"absent from the check: {', '.join(absent) or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("wheels", help="check a folder of wheels against the image's list").add_argument(
        "folder", type=Path)
    sub.add_parser("installed", help="check the running environment")
    sub.add_parser("simulate", help="link this machine's copies of the image's packages").add_argument(
        "folder", type=Path)
    args = parser.parse_args(argv)
    if args.mode == "wheels":
        return check_wheels(args.folder)
    if args.mode == "installed":
        return check_installed()
    return simulate(args.folder)


if __name__ == "__main__":
    sys.exit(main())
