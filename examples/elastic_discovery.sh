#!/bin/sh
# Host discovery for an elastic job (hora run --host-discovery-script examples/elastic_discovery.sh).
#
# hora run runs this about once a second. It prints the hosts available now, one per line, as "host" or
# "host:slots", and exits 0. Edit the hosts file while the job runs: an added line starts workers on that
# host, a removed line makes that host's workers leave at the next commit. In a cloud, print the instances
# of your scaling group instead (e.g. from the provider's CLI).
hosts_file="${ELASTIC_HOSTS_FILE:-$(dirname "$0")/elastic_hosts.txt}"
grep -v '^[[:space:]]*#' "$hosts_file" | grep -v '^[[:space:]]*$'
