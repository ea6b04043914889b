import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    from gbray.data.synth import SynthSettings, write_corpus

    out = tmp_path_factory.mktemp("corpus")
    write_corpus(SynthSettings(out=out, turns=800, eval_turns=150, seed=7, prompt_tokens=200))
    return out


@pytest.fixture(scope="session")
def raw_student(corpus, tmp_path_factory) -> Path:
    """The tiny shape with random weights (no pre-training): for unit tests of the machinery."""
    from gbray.student import StudentSettings, build_student

    out = tmp_path_factory.mktemp("student")
    build_student(StudentSettings(data=corpus, out=out, pretrain_steps=0, vocab=600))
    return out


@pytest.fixture(scope="session", autouse=True)
def student_cache(tmp_path_factory) -> Path:
    """The session's student cache: the demo's subprocess keeps its student here, never in the
    user's ~/.cache/gbray, so every run builds it as a fresh machine does."""
    cache = tmp_path_factory.mktemp("cache")
    os.environ["GBRAY_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def learnable(tmp_path_factory, student_cache) -> tuple[Path, Path]:
    """A corpus a tiny student learns well in minutes and that student: `gbray demo`'s own
    (its corpus, 16 tools and 150-token pages, and its student, pre-trained a fixed 450 steps:
    about 150 s on 2 AVX2-only cores). Built once, through the session's student cache, where
    the demo's run finds it as a second run on one machine does, so a CI run pre-trains one
    student, not two. The round, shares, exam and demo tests share it; a test that changes the
    data works on a copy."""
    from gbray.cli import DEMO_CORPUS
    from gbray.data.synth import SynthSettings, write_corpus
    from gbray.student import StudentSettings, build_student_kept

    root = tmp_path_factory.mktemp("learnable")
    write_corpus(SynthSettings(out=root / "data", seed=0, **DEMO_CORPUS))
    build_student_kept(
        StudentSettings(data=root / "data", out=root / "student", size="tiny", seed=0),
        student_cache,
    )
    return root / "data", root / "student"


@pytest.fixture(scope="session")
def tokenizer(raw_student):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(raw_student)


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module. A secret-named variable is set first, so the process records
    of the driver and of actors can be checked for leaving it out."""
    import ray

    os.environ["GBRAY_TEST_API_KEY"] = "must-not-leak"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
