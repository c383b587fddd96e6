"""The model runner: persistent batch, one step as prepare / sample / collect, forward
context, warm-up."""
