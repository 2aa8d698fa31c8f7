#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ when they are installed but stopped (tests need
# them), and MariaDB with `services.sh mariadb` (make test-mariadb).
# Under CI=true a service that cannot be started is an error; locally a warning.
set -u
fail=0
up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_up() { for _ in $(seq 1 60); do up "$1" && return 0; sleep 0.5; done; return 1; }

if ! up 5432; then
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  fi
  wait_up 5432 || { echo "PostgreSQL is not available on 127.0.0.1:5432"; fail=1; }
fi
if ! up 6379; then
  if command -v redis-server >/dev/null; then
    echo "starting Redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  fi
  wait_up 6379 || { echo "Redis is not available on 127.0.0.1:6379"; fail=1; }
fi
if ! up 5672; then
  if command -v rabbitmq-server >/dev/null; then
    echo "starting RabbitMQ"
    rabbitmq-server -detached || true
  fi
  # RabbitMQ takes a while to boot.
  for _ in $(seq 1 4); do wait_up 5672 && break; done
  up 5672 || { echo "RabbitMQ is not available on 127.0.0.1:5672"; fail=1; }
fi
if [ "${1:-}" = "mariadb" ] && ! up "${POOLS_MYSQL_PORT:-3306}"; then
  if [ -x /usr/sbin/mariadbd ]; then
    echo "starting MariaDB"
    mkdir -p /run/mysqld /var/log/mysql
    chown mysql:mysql /run/mysqld /var/log/mysql 2>/dev/null || true
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
  fi
  wait_up "${POOLS_MYSQL_PORT:-3306}" ||
    { echo "MariaDB/MySQL is not available on 127.0.0.1:${POOLS_MYSQL_PORT:-3306}"; fail=1; }
fi
if [ "$fail" = 1 ] && [ "${CI:-}" = "true" ]; then
  echo "CI=true: required services are missing" >&2
  exit 1
fi
exit 0
