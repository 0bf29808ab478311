// A legal but busy HBONE client on Node's built-in http2 module: one mTLS 1.3 + h2 connection
// that keeps `concurrency` CONNECT streams open at once (never more; Node's nghttp2 also holds
// new streams back at the server's SETTINGS_MAX_CONCURRENT_STREAMS) and opens the next one as
// soon as one closes, until `total` streams have run. Each stream sends `message`, half-closes
// and reads the echo to END_STREAM.
//
// Usage: node hbone_churn.js '<json>' with host, port, authority, cert, key, ca, concurrency,
// total[, message, timeoutSeconds].
// Prints one JSON line: how many streams ran, how they ended (ok, refused = RST_STREAM
// REFUSED_STREAM, other resets, other statuses), the most open at once, and the elapsed time.
'use strict';
const fs = require('fs');
const http2 = require('http2');

const cfg = JSON.parse(process.argv[2]);
const message = Buffer.from(cfg.message || 'churn\n');
const out = {
  started: 0, ok: 0, refused: 0, resets: {}, statuses: {}, badEcho: 0, maxOpen: 0,
  remoteMaxStreams: null, seconds: 0,
};
const t0 = Date.now();

function finish(error) {
  out.seconds = (Date.now() - t0) / 1000;
  if (error) out.error = String(error);
  console.log(JSON.stringify(out));
  process.exit(error ? 1 : 0);
}
setTimeout(() => finish('timed out'), (cfg.timeoutSeconds || 60) * 1000).unref();

const host = cfg.host.includes(':') ? `[${cfg.host}]` : cfg.host;
const session = http2.connect(`https://${host}:${cfg.port}`, {
  ca: fs.readFileSync(cfg.ca),
  cert: fs.readFileSync(cfg.cert),
  key: fs.readFileSync(cfg.key),
  minVersion: 'TLSv1.3',
  maxVersion: 'TLSv1.3',
  checkServerIdentity: () => undefined, // (the interop tests check the SAN; not this one)
});
session.on('error', (e) => finish(`session: ${e.message}`));
session.on('remoteSettings', (s) => { out.remoteMaxStreams = s.maxConcurrentStreams; });

let open = 0;
let done = 0;

function one() {
  out.started += 1;
  open += 1;
  out.maxOpen = Math.max(out.maxOpen, open);
  const req = session.request({ ':method': 'CONNECT', ':authority': cfg.authority });
  let status = null;
  const chunks = [];
  req.on('response', (headers) => {
    status = headers[':status'];
    if (status === 200) req.end(message); // DATA + END_STREAM
  });
  req.on('data', (c) => chunks.push(c));
  req.on('error', () => {}); // (a reset: counted at close)
  req.on('close', () => {
    open -= 1;
    done += 1;
    if (req.rstCode === http2.constants.NGHTTP2_REFUSED_STREAM) {
      out.refused += 1;
    } else if (req.rstCode) {
      out.resets[req.rstCode] = (out.resets[req.rstCode] || 0) + 1;
    } else if (status !== 200) {
      out.statuses[status] = (out.statuses[status] || 0) + 1;
    } else if (!Buffer.concat(chunks).equals(message)) {
      out.badEcho += 1;
    } else {
      out.ok += 1;
    }
    if (out.started < cfg.total) one();
    else if (done === cfg.total) session.close(() => finish(null));
  });
}

session.on('connect', () => {
  for (let i = 0; i < Math.min(cfg.concurrency, cfg.total); i++) one();
});
