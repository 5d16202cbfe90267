"""One step of the worker: a plan's rows staged, the forward run, tokens sampled and sent home
(``runner.ModelRunner``)."""
