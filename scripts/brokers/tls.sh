# shellcheck shell=bash
# Test TLS material for scripts/brokers.sh (sourced by it; uses its $TLS, log, die, apt_install).
#
# tls_ensure writes, once per broker dir (kept across `up`, which wipes only the brokers' data):
#   $TLS/ca.pem               a throwaway test CA (its key, ca.key, stays next to it)
#   $TLS/server.pem           a server certificate for 127.0.0.1 and localhost, signed by that CA
#   $TLS/server.key           its private key (PKCS#8, unencrypted; RabbitMQ reads it)
#   $TLS/kafka-keystore.pem   key + certificate chain in one file (Kafka: ssl.keystore.type=PEM)
# Clients trust ca.pem (tensorbus: ssl_cafile). Nothing here is a secret worth protecting.

tls_ensure() {
  if [[ -s $TLS/kafka-keystore.pem ]] && openssl x509 -checkend 86400 -noout -in "$TLS/server.pem" >/dev/null 2>&1
  then return 0; fi
  command -v openssl >/dev/null || apt_install openssl
  log "generating a test CA and a 127.0.0.1/localhost server certificate in $TLS"
  mkdir -p "$(dirname "$TLS")"
  local tmp; tmp=$(mktemp -d "$TLS.XXXXXX")   # built aside, moved into place whole
  (
    cd "$tmp"
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -keyout ca.key -out ca.pem \
      -subj "/CN=tensorbus test CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    openssl req -newkey rsa:2048 -nodes -sha256 -keyout server.key -out server.csr -subj "/CN=localhost"
    printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
      "extendedKeyUsage=serverAuth" "subjectAltName=IP:127.0.0.1,DNS:localhost" >server.ext
    openssl x509 -req -sha256 -days 825 -in server.csr -CA ca.pem -CAkey ca.key \
      -set_serial "0x$(openssl rand -hex 16)" -extfile server.ext -out server.pem
    cat server.key server.pem ca.pem >kafka-keystore.pem
    openssl verify -CAfile ca.pem server.pem
    rm -f server.csr server.ext
    chmod 600 ca.key server.key kafka-keystore.pem
  ) >"$tmp.log" 2>&1 || { rm -rf "$tmp"; fail_with_log "generating TLS material with openssl failed" "$tmp.log"; }
  rm -f "$tmp.log"
  rm -rf "$TLS"; mv "$tmp" "$TLS"; chmod 755 "$TLS"
}

tls_probe() {  # tls_probe PORT LOG: a TLS handshake on 127.0.0.1:PORT verifies against our CA (10 s at most)
  timeout 10 openssl s_client -connect "127.0.0.1:$1" -CAfile "$TLS/ca.pem" -verify_return_error \
    -verify_ip 127.0.0.1 -brief </dev/null >"$2" 2>&1
}
