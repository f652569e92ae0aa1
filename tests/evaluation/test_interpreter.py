"""The workers' interpreter is checked for the evaluators' modules when the config is read."""

import subprocess
import sys

import pytest

from areal_eval.config.parsing import ConfigError, FieldError
from areal_eval.evaluation.generation import GenerationConfig
from areal_eval.evaluation.interpreter import check_interpreter, missing_modules, required_modules
from areal_eval.pipeline.config import load_pipeline_config

pytestmark = pytest.mark.integration  # it runs interpreters


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A real virtual environment with nothing installed in it."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


def test_each_evaluator_names_the_modules_its_workers_import():
    vllm = GenerationConfig(backend="vllm", reward="exact_match")
    assert set(required_modules("generation,lm_eval", vllm)) == {
        "areal_eval", "torch", "transformers", "vllm", "lm_eval", "accelerate"
    }  # fmt: skip
    assert "math_verify" in required_modules("generation", GenerationConfig())
    assert set(required_modules("reward_model", GenerationConfig())) == {"areal_eval", "torch", "transformers"}


def test_this_interpreter_finds_what_it_has_and_names_what_it_lacks():
    assert missing_modules(sys.executable, ("json", "areal_eval", "no_such_module_here")) == ("no_such_module_here",)


def test_an_environment_without_the_packages_is_refused_naming_eval_python_and_each_module(bare_python):
    # areal_eval is found from the directory the workers start in, as they find it.
    expected = r"cannot import accelerate \(for eval.evaluator: lm_eval\); lm_eval \(for eval.evaluator: lm_eval\); "
    with pytest.raises(FieldError, match=expected):
        check_interpreter(bare_python, "lm_eval", GenerationConfig())
    with pytest.raises(
        ConfigError, match=r"eval.python: .* cannot import .*vllm \(for eval.generation.backend: vllm\)"
    ):
        load_pipeline_config(
            params={"eval": {"python": bare_python, "evaluator": "generation", "generation": {"backend": "vllm"}}}
        )
