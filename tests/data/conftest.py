"""Shared fixtures for the data tests: a small stdlib slice and a small BPE trained on it once."""
import pytest
from data_helpers import SMALL

from glm5_jax.data import DataConfig, build_data_pipeline


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_workdir"))


@pytest.fixture(scope="session")
def small_pipeline(workdir):
    """A ~120 kB stdlib corpus and its 512-token BPE (trained once per session, under a second)."""
    return build_data_pipeline(DataConfig(**SMALL), workdir, process_index=0, process_count=1,
                               show_progress=False)


@pytest.fixture(scope="session")
def tokenizer_file(small_pipeline, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    small_pipeline.tokenizer.save(path)
    return path
