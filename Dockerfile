# One image for every part of Rollout Queue: `rollout-queue api`, `rollout-queue worker KIND`, `rollout-queue up`.
#
#   docker build -t rollout-queue .                         # torch from PyPI: the CUDA build (GPU nodes)
#   docker build -t rollout-queue --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#                                                           # CPU-only torch, a much smaller image
FROM python:3.11-slim

ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # One torch thread per worker process (README, ROLLOUT_TORCH_THREADS: more threads than cores slow generation).
    OMP_NUM_THREADS=1 \
    ROLLOUT_STATE_DIR=/data \
    ROLLOUT_HOST=0.0.0.0

WORKDIR /app

# torch first, in its own layer: it is most of the image and changes least.
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0; \
    else pip install torch==2.13.0; fi

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY processors ./processors
COPY domain ./domain
COPY workers ./workers
COPY web ./web
COPY launcher ./launcher
COPY clients/python ./clients/python
RUN pip install ./clients/python .

# Not root; /data holds the state (the demo model is built there on first start) and is a volume.
RUN useradd --create-home --uid 10001 rollout && mkdir -p /data && chown rollout:rollout /data
USER rollout
VOLUME ["/data"]
EXPOSE 8000

ENTRYPOINT ["rollout-queue"]
CMD ["up"]
