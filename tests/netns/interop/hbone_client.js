// An HBONE client on Node's built-in http2 module: mTLS 1.3 + ALPN h2, one CONNECT stream.
//
// Usage: node hbone_client.js '<json>' with
//   host, port         the HBONE server (ztunnel's 15008)
//   authority          the CONNECT :authority ("ip:port" or "[ip6]:port")
//   cert, key, ca      PEM files: client chain, client key, trust roots
//   expectSan          a URI SAN the server certificate must carry
//   sendBytes          how many random bytes to send
//   sendAfterEnd       true: send only after the server half-closed (END_STREAM) its side
// Prints one JSON line: status, TLS facts, and count + sha256 of what was sent and received.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const http2 = require('http2');

const cfg = JSON.parse(process.argv[2]);
const out = { status: null, sent: null, received: null };

function fail(msg) {
  out.error = String(msg);
  console.log(JSON.stringify(out));
  process.exit(1);
}
setTimeout(() => fail('timed out'), (cfg.timeoutSeconds || 20) * 1000).unref();

const host = cfg.host.includes(':') ? `[${cfg.host}]` : cfg.host;
const session = http2.connect(`https://${host}:${cfg.port}`, {
  ca: fs.readFileSync(cfg.ca),
  cert: fs.readFileSync(cfg.cert),
  key: fs.readFileSync(cfg.key),
  minVersion: 'TLSv1.3',
  maxVersion: 'TLSv1.3',
  // HBONE has no host names: the server is identified by a SPIFFE URI SAN.
  checkServerIdentity: (_name, cert) => {
    const sans = (cert.subjectaltname || '').split(', ');
    if (!sans.includes(`URI:${cfg.expectSan}`)) {
      return new Error(`server SANs ${cert.subjectaltname} lack ${cfg.expectSan}`);
    }
    return undefined;
  },
});
session.on('error', (e) => fail(`session: ${e.message}`));

session.on('connect', () => {
  const sock = session.socket;
  out.alpn = sock.alpnProtocol;
  out.tls = sock.getProtocol();
  out.serverSan = sock.getPeerCertificate().subjectaltname;
});

const req = session.request({ ':method': 'CONNECT', ':authority': cfg.authority });
req.on('error', (e) => fail(`stream: ${e.message}`));
req.on('response', (headers) => {
  out.status = headers[':status'];
  out.baggage = headers.baggage || null;
  if (out.status !== 200) {
    req.close();
    session.close();
    console.log(JSON.stringify(out));
    process.exit(0);
  }
  if (!cfg.sendAfterEnd) send();
});

const rx = crypto.createHash('sha256');
let rxCount = 0;
let rxText = Buffer.alloc(0);
req.on('data', (chunk) => {
  rx.update(chunk);
  rxCount += chunk.length;
  if (rxText.length < 200) rxText = Buffer.concat([rxText, chunk.subarray(0, 200)]);
});
req.on('end', () => {
  out.received = { count: rxCount, sha256: rx.digest('hex'), headHex: rxText.toString('hex') };
  if (cfg.sendAfterEnd) send();
  maybeDone();
});

let sending = false;
function send() {
  if (sending) return;
  sending = true;
  const tx = crypto.createHash('sha256');
  let left = cfg.sendBytes;
  const pump = () => {
    while (left > 0) {
      const chunk = crypto.randomBytes(Math.min(left, 64 * 1024));
      left -= chunk.length;
      tx.update(chunk);
      if (!req.write(chunk)) {
        req.once('drain', pump);
        return;
      }
    }
    req.end(); // END_STREAM: the half-close
    out.sent = { count: cfg.sendBytes, sha256: tx.digest('hex') };
    maybeDone();
  };
  pump();
}

let finishing = false;
function maybeDone() {
  if (out.sent === null || out.received === null || finishing) return;
  finishing = true;
  const finish = () => {
    out.rstCode = req.rstCode;
    // A PING round trip first: once its ACK is back the server has read every frame sent before
    // it (TCP keeps the order), DATA and END_STREAM included. Exiting sooner can close the
    // socket with the server's frames unread, which makes the kernel send RST and drop what
    // was still queued for the server.
    session.ping(() => {
      session.close(() => {
        console.log(JSON.stringify(out));
        process.exit(0);
      });
    });
  };
  if (req.closed) finish();
  else req.on('close', finish);
}
