# compose.yaml's one-shot `enroll` (busybox sh in the tools image): the first
# root credential, a pool "sim" and a join token with a use per simulated
# node, kept in $FLEET_DIR for the `fleet` service. A later start finds the
# token and does nothing.
set -eu
dir=${FLEET_DIR:?FLEET_DIR is required}
nodes=${FLEET_NODES:-3}
bc=/usr/local/bin/better-compute
if [ -s "$dir/join-token" ]; then
	echo "a join token is already in $dir"
	exit 0
fi
umask 077
# bootstrap prints the key on a line of its own, indented.
cred=$("$bc" bootstrap | sed -n 's/^  \([A-Za-z0-9_.-]*\)$/\1/p' | head -n 1)
if [ -z "$cred" ]; then
	echo "bootstrap printed no credential" >&2
	exit 1
fi
printf '%s\n' "$cred" >"$dir/root-credential"
export BETTER_COMPUTE_TOKEN="$cred"
pool=$("$bc" api pools.create tenantId=root name=sim class=gpu | sed -n 's/^ *"id": "\([^"]*\)".*/\1/p' | head -n 1)
if [ -z "$pool" ]; then
	echo "pools.create answered no pool id" >&2
	exit 1
fi
token=$("$bc" api joinTokens.create tenantId=root poolId="$pool" uses:="$nodes" | sed -n 's/^ *"token": "\(bcjt_[^"]*\)".*/\1/p' | head -n 1)
if [ -z "$token" ]; then
	echo "joinTokens.create answered no token" >&2
	exit 1
fi
printf '%s\n' "$token" >"$dir/join-token.tmp"
mv "$dir/join-token.tmp" "$dir/join-token"
echo "pool $pool, a join token for $nodes nodes in $dir/join-token; the root credential is in $dir/root-credential"
