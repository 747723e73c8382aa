"""Where things live on disk: the one definition of the repository root and of the caches under it."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Converted engines (ONNX files, Inductor kernels, the default engine's measured choice): gitignored.
ENGINE_CACHE_DIR = Path(os.environ.get("SFS_ENGINE_CACHE", REPO_ROOT / ".cache" / "engines"))
