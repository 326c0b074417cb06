try:
    from tests.distributed.llama64 import in_float64
except ModuleNotFoundError:
    from llama64 import in_float64
build_model, example_inputs, example_target, loss_fn = in_float64("hf_bert")
