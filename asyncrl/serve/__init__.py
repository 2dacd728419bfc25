"""``asyncrl serve``: the in-process JaxEngine behind SGLang's native HTTP API (the RL subset).

So users without SGLang can run rollout servers on other hosts, and the tests exercise
:class:`~asyncrl.engine.remote.RemoteEngine` against real servers. Requests and answers are the
models of :mod:`asyncrl.engine.sglang_protocol`; the stack is Starlette on uvicorn.

Semantics that matter for exact per-token versions:

* ``/pause_generation`` (mode ``abort``) ends every in-flight request at once with the tokens it
  has (finish type ``abort``) and holds new ``/generate`` requests until ``/continue_generation``.
  ``retract`` and ``in_place`` are refused (400): the JaxEngine cannot park requests.
* ``/update_weights_from_disk`` always runs with generation paused (it pauses and aborts itself
  when the caller did not), so every answer's tokens come from one set of weights, named by its
  ``meta_info.weight_version``. It loads only directories under ``--weights-root`` (403 otherwise;
  no root: updates are refused).
* ``/update_weights_from_disk`` re-reads only what changed: a publish's index carries each
  tensor's sha256 (``metadata.tensor_sha256``, :mod:`asyncrl.engine.publish`); a tensor whose hash
  equals that of the tensor this server loaded last is kept as it is on the device (a LoRA run's
  frozen base, embeddings, norms that did not move), the others are read. An index without hashes
  (a plain HF checkpoint) is read whole. ``/get_server_info`` reports ``serve/tensors_read``,
  ``serve/bytes_read`` and ``serve/tensors_kept`` of the last load. (A tied ``lm_head`` is not a
  tensor of its own: it is read once, as the embedding.)
* LoRA (SGLang's ``/load_lora_adapter``, ``/unload_lora_adapter`` and ``/generate``'s ``lora_path``;
  see :mod:`asyncrl.engine.sglang_protocol`): a PEFT adapter directory under ``--weights-root`` is
  checked against the model (every tensor names a linear layer, has its A/B partner and the
  shape of ``r``; else 400 naming the tensor) and applied to the base weights, ``W + (alpha / r) *
  A @ B``; the engine then serves the merged weights. Unlike SGLang, asyncrl serve applies one
  adapter at a time: a request naming the active adapter runs; one naming an adapter loaded
  earlier and since replaced comes back at once with no tokens and finish type ``abort`` (the
  remote engine resubmits it under the new adapter, as after a pause), and so does one naming no
  adapter while one is applied (asyncrl serve holds no separate base to run it on); one naming an
  unknown adapter is refused (400). ``/update_weights_from_disk`` replaces the base and drops every
  adapter.
* ``--api-key``: every endpoint needs ``Authorization: Bearer KEY`` (401 otherwise).
* ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``: the OpenAI-compatible API of
  :mod:`asyncrl.agent.api` over the same engine (the model directory's tokenizer and chat
  template; no streaming), held while paused like ``/generate``. See docs/agents.md.
* SIGTERM: uvicorn stops accepting, finishes in-flight answers (up to 10 s), then the engine stops.

The server sits above the run (its engine is built by the run's one rule,
:func:`asyncrl.run.build.build_local_engine`) and the agents (it answers their OpenAI routes):
:mod:`~asyncrl.serve.state` holds the engine and the handlers' logic, :mod:`~asyncrl.serve.app`
the Starlette routes, :mod:`~asyncrl.serve.server` the start-up and ``serve`` itself.
"""
