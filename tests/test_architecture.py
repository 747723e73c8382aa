"""The architecture's rules, checked on the source: packages depend one way, chapters only on earlier
chapters, and the HTTP layer's OpenAPI document describes the whole contract."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from chapters import CHAPTERS
from shared.paths import REPO_ROOT


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def python_files(package: str) -> list[Path]:
    return sorted(p for p in (REPO_ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize(("package", "forbidden"), [("shared", ("chapters", "benchmarks", "exercises")), ("chapters", ("benchmarks", "exercises"))])
def test_packages_depend_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    offenders = {
        str(path.relative_to(REPO_ROOT)): sorted(name for name in imports_of(path) if name.split(".")[0] in forbidden)
        for path in python_files(package)
    }
    assert not {path: names for path, names in offenders.items() if names}


def test_a_chapter_imports_only_itself_and_earlier_chapters() -> None:
    order = {folder: index for index, folder in enumerate(CHAPTERS.values())}
    for folder, index in order.items():
        for path in python_files(f"chapters/{folder}"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[0] == "chapters" and len(parts) > 1 and parts[1] in order:
                    assert order[parts[1]] <= index, f"{path.relative_to(REPO_ROOT)} imports the later chapter {parts[1]}"


def test_the_openapi_document_declares_the_request_body_and_every_error() -> None:
    from fastapi.testclient import TestClient

    from chapters.ch02_fastapi_async.server import build_app
    from shared.settings import ServerSettings

    with TestClient(build_app(ServerSettings(weights="dummy", device="cpu"))) as client:
        operation = client.get("/openapi.json").json()["paths"]["/v1/inference"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert {"input_ids", "prompt", "max_new_tokens"} <= set(schema["properties"])
    assert {"200", "400", "413", "422", "429", "500", "503", "504"} <= set(operation["responses"])
