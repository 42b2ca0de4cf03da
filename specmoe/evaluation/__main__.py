"""`python3 -m specmoe.evaluation ARGS`: lm-eval's command line (`lm-eval ARGS`) with the ``specmoe`` model
registered, e.g. `python3 -m specmoe.evaluation run --model specmoe --model_args policy=psr,capacity=32 ...`."""

from .lm_eval_model import MODEL_NAME  # noqa: F401  (registers the model)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
