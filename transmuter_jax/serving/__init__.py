"""An OpenAI-compatible server: ``transmuter-jax serve`` (docs/serving.md).

Modules: ``protocol`` (request bodies, OpenAI's error shape), ``backend`` (the one seam to the
generation engine), ``scheduler`` (admission, a request's events and timings), ``metrics``
(Prometheus), ``app`` (the FastAPI routes), ``cli`` (the command). Importing this package
imports neither jax nor the server's packages; they load with the model.
"""
