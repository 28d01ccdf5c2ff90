# Prometheus from Debian's package, running as the user `prometheus`; the configuration is
# mounted at /etc/prometheus (docker-compose.yml mounts ops/prometheus), data in /prometheus.
#
#   docker build -f ops/images/prometheus.Dockerfile -t fleet-prometheus ops/images
#
# BASE_IMAGE: see rabbitmq.Dockerfile. Only the server binary is taken from the package
# (`dpkg -x`): installing the package would pull in 300 MB of JavaScript libraries for the
# web UI. The HTTP API (/api/v1/...) is complete; the bundled web pages are not.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends curl \
 && cd /tmp \
 && apt-get download prometheus \
 && dpkg -x prometheus_*.deb /tmp/pkg \
 && install -m 0755 /tmp/pkg/usr/bin/prometheus /usr/local/bin/prometheus \
 && rm -rf /tmp/pkg /tmp/prometheus_*.deb /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && useradd --system --user-group --home-dir /prometheus --no-create-home \
        --shell /usr/sbin/nologin prometheus \
 && mkdir -p /prometheus /etc/prometheus \
 && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
HEALTHCHECK --interval=10s --timeout=3s --retries=6 \
    CMD ["curl", "-fsS", "-o", "/dev/null", "http://127.0.0.1:9090/-/ready"]
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
