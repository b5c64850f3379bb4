# Sourced by GPU scripts: the modules the worker, the router and the load generator import that
# the device image may lack, as module:wheel pairs for bench/gpu_env.sh (carried in .whl/).
# ENGINE_DEPS: what an engine in-process (bench/engine.py, tp.py, moe.py, ...) imports; the
# servers and the load generator need SERVER_DEPS.
ENGINE_DEPS=(zmq:pyzmq llguidance:llguidance nixl_cu13:nixl_cu13 prometheus_client:prometheus_client
  pydantic:pydantic pydantic_core:pydantic_core annotated_types:annotated_types typing_inspection:typing_inspection
  fastapi:fastapi starlette:starlette annotated_doc:annotated_doc)
SERVER_DEPS=("${ENGINE_DEPS[@]}" typing_extensions:typing_extensions opentelemetry:opentelemetry_api
  anyio:anyio idna:idna uvicorn:uvicorn click:click h11:h11 httptools:httptools
  httpx:httpx httpcore:httpcore certifi:certifi aiohttp:aiohttp aiosignal:aiosignal frozenlist:frozenlist
  multidict:multidict yarl:yarl propcache:propcache aiohappyeyeballs:aiohappyeyeballs attrs:attrs tqdm:tqdm)
ls .whl/uvloop-*.whl >/dev/null 2>&1 && SERVER_DEPS+=(uvloop:uvloop)  # optional: uvicorn's and the client's loop
