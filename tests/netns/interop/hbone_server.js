// An HBONE server on Node's built-in http2 module, standing in for ztunnel's inbound 15008:
// mTLS 1.3 (client certificate required, verified against the mesh root, then checked for a
// SPIFFE identity in the trust domain), ALPN h2, CONNECT -> 200 and a TCP connection to the
// :authority piped both ways with half-close kept; anything else -> 400; refused -> 503.
// With `reply` set it stands in for a waypoint that answers by itself, as the Rust tests'
// `run_hbone_server` does: CONNECT -> 200, the reply text, then an echo of the stream until
// END_STREAM, with no connection to the :authority.
//
// With `forward` ({host, port}) it stands in for a network's east-west gateway in double HBONE:
// whatever the :authority (a service hostname), the stream is piped to that fixed address, where
// the destination's own HBONE server terminates the inner tunnel.
//
// With `refuseOnce` (a list of authorities) the first stream for each of them is reset with
// REFUSED_STREAM before any work, as a server at its stream limit (or draining) would.
//
// Usage: node hbone_server.js '<json>' with port, cert, key, ca, trustDomain[, reply,
// responseBaggage, forward, refuseOnce].
// Prints "READY <port>", then one JSON line per stream event; `client` is the client's TCP port,
// which tells its HTTP/2 connections apart.
'use strict';
const fs = require('fs');
const http2 = require('http2');
const net = require('net');

const cfg = JSON.parse(process.argv[2]);
const log = (o) => console.log(JSON.stringify(o));

const server = http2.createSecureServer({
  cert: fs.readFileSync(cfg.cert),
  key: fs.readFileSync(cfg.key),
  ca: fs.readFileSync(cfg.ca),
  requestCert: true,
  rejectUnauthorized: true,
  minVersion: 'TLSv1.3',
  maxVersion: 'TLSv1.3',
  allowHTTP1: false,
});

server.on('secureConnection', (sock) => {
  const sans = (sock.getPeerCertificate().subjectaltname || '').split(', ');
  if (!sans.some((s) => s.startsWith(`URI:spiffe://${cfg.trustDomain}/`))) {
    log({ event: 'rejected', sans });
    sock.destroy();
  }
});
server.on('tlsClientError', (e) => log({ event: 'tlsError', error: e.message }));

function splitAuthority(a) {
  const m = /^\[([0-9a-fA-F:.]+)\]:(\d+)$/.exec(a) || /^([0-9.]+):(\d+)$/.exec(a);
  return m ? { host: m[1], port: Number(m[2]) } : null;
}

const refuseOnce = new Set(cfg.refuseOnce || []);

server.on('stream', (stream, headers) => {
  const sock = stream.session.socket;
  if (refuseOnce.delete(headers[':authority'])) {
    log({ event: 'refused', authority: headers[':authority'], client: sock.remotePort });
    stream.on('error', () => {}); // (Node reports the reset it sent as an error)
    stream.close(http2.constants.NGHTTP2_REFUSED_STREAM);
    return;
  }
  const info = {
    event: 'request',
    method: headers[':method'],
    authority: headers[':authority'],
    scheme: headers[':scheme'] || null,
    path: headers[':path'] || null,
    baggage: headers.baggage || null,
    forwarded: headers.forwarded || null,
    traceparent: headers.traceparent || null,
    forwardedNetwork: headers['x-forwarded-network'] ?? null,
    alpn: sock.alpnProtocol,
    tls: sock.getProtocol(),
    clientSan: sock.getPeerCertificate().subjectaltname,
    client: sock.remotePort,
  };
  let target = info.method === 'CONNECT' ? splitAuthority(info.authority || '') : null;
  if (info.method === 'CONNECT' && info.authority && (cfg.reply !== undefined || cfg.forward)) {
    target = cfg.forward || { host: null, port: null }; // any authority, hostnames included
  }
  log(info);
  if (target === null) {
    stream.respond({ ':status': 400 }, { endStream: true });
    return;
  }
  if (typeof cfg.reply === 'string') {
    let echoed = 0;
    const head = { ':status': 200 };
    if (cfg.responseBaggage) head.baggage = cfg.responseBaggage; // as a ztunnel's 200 carries
    stream.respond(head);
    stream.write(cfg.reply);
    stream.on('data', (c) => { echoed += c.length; stream.write(c); });
    stream.on('end', () => stream.end());
    stream.on('error', () => {});
    stream.on('close', () => {
      log({ event: 'closed', authority: info.authority, up: echoed, down: echoed + cfg.reply.length, rstCode: stream.rstCode });
    });
    return;
  }
  let up = 0;
  let down = 0;
  const app = net.connect({ host: target.host, port: target.port, allowHalfOpen: true });
  app.on('connect', () => {
    stream.respond({ ':status': 200 });
    stream.on('data', (c) => { up += c.length; });
    app.on('data', (c) => { down += c.length; });
    stream.pipe(app); // END_STREAM -> FIN to the app
    app.pipe(stream); // FIN from the app -> END_STREAM
  });
  app.on('error', (e) => {
    if (!stream.headersSent) {
      stream.respond({ ':status': 503 }, { endStream: true });
    } else {
      stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR);
    }
    log({ event: 'appError', authority: info.authority, error: e.message });
  });
  stream.on('error', () => app.destroy());
  stream.on('close', () => {
    log({ event: 'closed', authority: info.authority, up, down, rstCode: stream.rstCode });
    if (stream.rstCode) app.destroy(); // reset: drop the app; else the pipes finish the job
  });
});

server.listen(cfg.port, '::', () => console.log(`READY ${cfg.port}`));
process.on('SIGTERM', () => process.exit(0));
