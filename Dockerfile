# cdcd container image: docker build -t cdcd:0.1.0 .
# Runs as an unprivileged user with a read-only root file system in mind
# (deploy/kubernetes/deployment.yaml mounts /etc/cdcd, /var/lib/cdcd and /tmp).
FROM python:3.11-slim

LABEL org.opencontainers.image.title="cdcd" \
      org.opencontainers.image.description="PostgreSQL change-data-capture daemon: pgoutput to Kafka with Avro envelopes, confirmed only after delivery" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Fixed uid/gid 10001: matches runAsUser/fsGroup in the Kubernetes manifests.
RUN groupadd --system --gid 10001 cdcd \
 && useradd --system --uid 10001 --gid cdcd --home-dir /var/lib/cdcd --no-create-home \
            --shell /usr/sbin/nologin cdcd \
 && install -d -m 0755 -o root -g root /etc/cdcd \
 && install -d -m 0750 -o cdcd -g cdcd /var/lib/cdcd

WORKDIR /src
# Dependencies ship as wheels (psycopg2-binary, confluent-kafka with its own
# librdkafka). gcc is only there to compile cdcd's optional C extensions (the
# hot path, setup.py; librdkafka-dev for the producer's header only: it runs
# confluent-kafka's own library) and is removed in the same layer; should it not install,
# the build still succeeds and cdcd runs its pure-Python path.
COPY pyproject.toml setup.py README.md ./
COPY cdcd ./cdcd
RUN { apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev librdkafka-dev \
      || echo "no C compiler: cdcd runs its pure-Python path"; } \
 && pip install --no-cache-dir . \
 && { apt-get purge -y --auto-remove gcc libc6-dev librdkafka-dev || true; } \
 && rm -rf /var/lib/apt/lists/* /src

WORKDIR /var/lib/cdcd
USER 10001:10001

# /metrics, /healthz, /readyz (metrics.listen).
EXPOSE 9187
# SIGTERM drains in-flight messages, confirms them and exits 0; give the
# container enough stop time (docker stop -t 120, terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
# No curl in slim images: urllib raises on a non-2xx status, so a 503 from
# /healthz (main loop stalled) fails the check. Assumes the default port.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9187/healthz', timeout=4)"]

ENTRYPOINT ["cdcd"]
CMD ["run", "-c", "/etc/cdcd/cdcd.yaml"]
