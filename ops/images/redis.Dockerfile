# Redis from Debian's package, running as the user `redis`, without persistence (fleet keeps
# only state in Redis that may be lost and rebuilt).
#
#   docker build -f ops/images/redis.Dockerfile -t fleet-redis ops/images
#
# BASE_IMAGE: see rabbitmq.Dockerfile. Protected mode is off as in the official image: the
# port is reachable only on the compose project's own network (docker-compose.yml publishes
# no Redis port).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* /var/log/redis/*
USER redis
WORKDIR /var/lib/redis
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --retries=12 CMD ["redis-cli", "ping"]
CMD ["redis-server", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
