//! Who may use the console: the token file, bearer tokens, the session cookie
//! derived from a token, and the per-session CSRF token.
//!
//! The token file holds one JSON object a line (blank lines and lines starting
//! with `#` are skipped):
//! `{"name": "alice", "sha256": "<hex SHA-256 of the token>", "tenants": ["acme"], "payloads": false}`.
//! Only the hash is stored; `tenants` absent or `null` means every tenant;
//! `payloads` (default false) allows showing run requests, event bodies and
//! outbox payloads. The token's name is the actor in `ferry_audit`.
//!
//! A token is compared in constant time against every entry (no early exit),
//! so timing reveals neither which entry matched nor how much of a hash did.
//! The session cookie is `<name>~<issued ms>~<HMAC(server key, name, issued,
//! token hash)>`: it proves the token was presented without containing it, and
//! dies after its lifetime or with the server key (a restart). The token file
//! is read once at start: removing a line revokes its token (and its
//! sessions) at the next restart, not before; signing out clears the cookie
//! in the browser only. The CSRF token is an HMAC of the credential (cookie or
//! token hash) under the server key, so it is per session and never stored.

use std::time::Duration;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ConsoleError;

type HmacSha256 = Hmac<Sha256>;

/// Name of the session cookie.
pub const SESSION_COOKIE: &str = "ferry_console_session";

/// One line of the token file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenEntry {
    /// Who the token belongs to: shown in the page header and written as the
    /// actor of every audited action.
    pub name: String,
    /// SHA-256 of the token (the token itself is never stored).
    sha256: [u8; 32],
    /// The tenants the token may see and act on; `None` is every tenant.
    pub tenants: Option<Vec<String>>,
    /// Whether pages may show payloads (run requests, event bodies, outbox payloads).
    pub payloads: bool,
}

#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct Line {
    name: String,
    sha256: String,
    #[serde(default)]
    tenants: Option<Vec<String>>,
    #[serde(default)]
    payloads: bool,
}

/// The tokens the console accepts (parsed from the token file).
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    entries: Vec<TokenEntry>,
}

impl Tokens {
    /// Parses a token file's text. Refuses a malformed line, a hash that is
    /// not 64 hex digits, an empty or duplicate name, a token on two lines,
    /// an empty tenant list or a tenant that is not a tenant name
    /// (`[A-Za-z0-9._:-]`, as Ferry names them), and a file with no token at
    /// all (the console would admit nobody).
    pub fn parse(text: &str) -> Result<Tokens, ConsoleError> {
        let mut entries: Vec<TokenEntry> = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: String| ConsoleError::TokenFile(format!("line {}: {why}", n + 1));
            let l: Line = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
            let valid_name = !l.name.is_empty()
                && l.name.len() <= 64
                && l.name.chars().all(|c| c.is_ascii_alphanumeric() || "._@-".contains(c));
            if !valid_name {
                return Err(bad("name must be 1-64 of [A-Za-z0-9._@-]".into()));
            }
            if entries.iter().any(|e| e.name == l.name) {
                return Err(bad(format!("duplicate name {:?}", l.name)));
            }
            let mut sha256 = [0u8; 32];
            hex::decode_to_slice(l.sha256.trim(), &mut sha256)
                .map_err(|_| bad("sha256 must be 64 hex digits (the SHA-256 of the token)".into()))?;
            // One token, one line: with two, the lookup would pick one and
            // silently give the token the other line's scope and name.
            if entries.iter().any(|e| e.sha256 == sha256) {
                return Err(bad(format!("the token of {:?} is already on another line", l.name)));
            }
            let tenant_name =
                |t: &String| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
            if l.tenants
                .as_ref()
                .is_some_and(|t| t.is_empty() || !t.iter().all(tenant_name))
            {
                return Err(bad("tenants must be absent, null, or a list of tenant names".into()));
            }
            entries.push(TokenEntry {
                name: l.name,
                sha256,
                tenants: l.tenants,
                payloads: l.payloads,
            });
        }
        if entries.is_empty() {
            return Err(ConsoleError::TokenFile("no token in the token file".into()));
        }
        Ok(Tokens { entries })
    }

    /// The token file line for `token` (what `ferry console token` prints).
    pub fn line_for(name: &str, token: &str, tenants: Option<&[String]>, payloads: bool) -> String {
        let line = Line {
            name: name.to_owned(),
            sha256: hex::encode(Sha256::digest(token.as_bytes())),
            tenants: tenants.map(<[String]>::to_vec),
            payloads,
        };
        serde_json::to_string(&line).unwrap_or_default()
    }

    /// A new random token: 32 bytes from the OS generator, hex-encoded.
    pub fn generate_token() -> String {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        hex::encode(bytes)
    }

    /// The entry whose hash is the token's, compared in constant time against
    /// every entry.
    fn by_token(&self, token: &str) -> Option<&TokenEntry> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for e in &self.entries {
            if bool::from(e.sha256.ct_eq(&digest)) {
                found = Some(e);
            }
        }
        found
    }

    fn by_name(&self, name: &str) -> Option<&TokenEntry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

/// Who is asking, once authenticated.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The token's name (the audit actor).
    pub name: String,
    /// The token's tenant scope; `None` is every tenant.
    pub tenants: Option<Vec<String>>,
    /// Whether payloads may be shown.
    pub payloads: bool,
    /// This credential's CSRF token, put in every form and checked on POST.
    pub csrf: String,
}

impl Principal {
    /// Whether the token may see and act on `tenant`.
    pub fn allows(&self, tenant: &str) -> bool {
        self.tenants.as_ref().is_none_or(|t| t.iter().any(|x| x == tenant))
    }

    /// The tenant filter a page uses: the requested tenant if the token
    /// allows it (else [`ConsoleError::Forbidden`]); with none requested,
    /// every tenant for an unscoped token and the first of its tenants for a
    /// scoped one.
    pub fn scope(&self, requested: Option<&str>) -> Result<Option<String>, ConsoleError> {
        match requested.map(str::trim).filter(|t| !t.is_empty()) {
            Some(t) if self.allows(t) => Ok(Some(t.to_owned())),
            Some(_) => Err(ConsoleError::Forbidden("this token is not scoped to that tenant")),
            None => Ok(self.tenants.as_ref().and_then(|t| t.first().cloned())),
        }
    }

    /// Refuses an action on `tenant` the token may not touch.
    pub fn check(&self, tenant: &str) -> Result<(), ConsoleError> {
        if self.allows(tenant) {
            Ok(())
        } else {
            Err(ConsoleError::Forbidden("this token is not scoped to that tenant"))
        }
    }
}

/// The tokens and the server key: authenticates requests, issues sessions.
#[derive(Debug)]
pub struct Auth {
    tokens: Tokens,
    key: [u8; 32],
    session_ttl: Duration,
}

impl Auth {
    /// Accepts `tokens`, with a fresh random server key (sessions and CSRF
    /// tokens of an earlier process are void) and sessions that last `session_ttl`.
    pub fn new(tokens: Tokens, session_ttl: Duration) -> Auth {
        let mut key = [0u8; 32];
        rand::rng().fill_bytes(&mut key);
        Auth {
            tokens,
            key,
            session_ttl,
        }
    }

    fn mac(&self, parts: &[&[u8]]) -> String {
        let mut m = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        for p in parts {
            m.update(&(p.len() as u64).to_be_bytes());
            m.update(p);
        }
        hex::encode(m.finalize().into_bytes())
    }

    fn principal(&self, e: &TokenEntry, credential: &str) -> Principal {
        Principal {
            name: e.name.clone(),
            tenants: e.tenants.clone(),
            payloads: e.payloads,
            csrf: self.mac(&[b"csrf", credential.as_bytes()]),
        }
    }

    /// The principal of a bearer token, if the file has it.
    pub fn bearer(&self, token: &str) -> Option<Principal> {
        let e = self.tokens.by_token(token)?;
        Some(self.principal(e, &hex::encode(e.sha256)))
    }

    /// A session cookie value for `token` issued at `now_ms`, with its
    /// principal; `None` when the token is unknown.
    pub fn login(&self, token: &str, now_ms: i64) -> Option<(String, Principal)> {
        let e = self.tokens.by_token(token)?;
        let issued = now_ms.to_string();
        let mac = self.mac(&[b"session", e.name.as_bytes(), issued.as_bytes(), &e.sha256]);
        let cookie = format!("{}~{issued}~{mac}", e.name);
        let p = self.principal(e, &cookie);
        Some((cookie, p))
    }

    /// The principal of a session cookie value, if it is genuine, unexpired
    /// at `now_ms`, and its token is still in the file.
    pub fn session(&self, cookie: &str, now_ms: i64) -> Option<Principal> {
        let mut parts = cookie.splitn(3, '~');
        let (name, issued, mac) = (parts.next()?, parts.next()?, parts.next()?);
        let e = self.tokens.by_name(name)?;
        let want = self.mac(&[b"session", name.as_bytes(), issued.as_bytes(), &e.sha256]);
        if !bool::from(want.as_bytes().ct_eq(mac.as_bytes())) {
            return None;
        }
        let issued: i64 = issued.parse().ok()?;
        let ttl = i64::try_from(self.session_ttl.as_millis()).unwrap_or(i64::MAX);
        if now_ms < issued || now_ms - issued > ttl {
            return None;
        }
        Some(self.principal(e, cookie))
    }

    /// Checks a submitted CSRF token against the principal's, in constant time.
    pub fn csrf_ok(principal: &Principal, submitted: &str) -> bool {
        bool::from(principal.csrf.as_bytes().ct_eq(submitted.as_bytes()))
    }

    /// Seconds a session lasts (the cookie's `Max-Age`).
    pub fn session_secs(&self) -> u64 {
        self.session_ttl.as_secs()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> Tokens {
        let text = format!(
            "# ops\n{}\n\n{}\n",
            Tokens::line_for("root", "s3cret", None, true),
            Tokens::line_for("acme-ops", "other", Some(&["acme".to_owned()]), false)
        );
        Tokens::parse(&text).unwrap()
    }

    #[test]
    fn a_token_finds_its_entry_and_nothing_else_does() {
        let auth = Auth::new(tokens(), Duration::from_secs(60));
        assert_eq!(auth.bearer("s3cret").unwrap().name, "root");
        let scoped = auth.bearer("other").unwrap();
        assert_eq!(scoped.tenants.as_deref(), Some(&["acme".to_owned()][..]));
        assert!(!scoped.payloads);
        assert!(auth.bearer("s3cre").is_none());
        assert!(auth.bearer("").is_none());
    }

    #[test]
    fn a_session_is_bound_to_the_key_its_lifetime_and_its_token() {
        let auth = Auth::new(tokens(), Duration::from_secs(60));
        let (cookie, p) = auth.login("s3cret", 1_000).unwrap();
        assert!(!cookie.contains("s3cret"));
        assert_eq!(auth.session(&cookie, 2_000).unwrap().csrf, p.csrf);
        assert!(auth.session(&cookie, 1_000 + 60_001).is_none(), "expired");
        assert!(
            auth.session(&cookie.replace("root", "acme-ops"), 2_000).is_none(),
            "renamed"
        );
        let flipped = if cookie.ends_with('0') { '1' } else { '0' };
        let forged = format!("{}{flipped}", &cookie[..cookie.len() - 1]);
        assert!(auth.session(&forged, 2_000).is_none(), "forged MAC");
        let other_process = Auth::new(tokens(), Duration::from_secs(60));
        assert!(other_process.session(&cookie, 2_000).is_none(), "new server key");
        assert!(Auth::csrf_ok(&p, &p.csrf));
        assert!(
            !Auth::csrf_ok(&p, &auth.bearer("s3cret").unwrap().csrf),
            "per credential"
        );
    }

    #[test]
    fn one_token_on_two_lines_is_refused() {
        let text = format!(
            "{}\n{}\n",
            Tokens::line_for("acme-ops", "same", Some(&["acme".to_owned()]), false),
            Tokens::line_for("root", "same", None, true)
        );
        assert!(Tokens::parse(&text).is_err(), "the second line would widen the token");
    }

    #[test]
    fn malformed_token_files_are_refused() {
        for bad in [
            "",
            "# nothing\n",
            "{\"name\":\"a\",\"sha256\":\"zz\"}",
            "{\"name\":\"\",\"sha256\":\"00\"}",
            "{\"name\":\"a b\",\"sha256\":\"0000000000000000000000000000000000000000000000000000000000000000\"}",
            "{\"name\":\"a\",\"sha256\":\"0000000000000000000000000000000000000000000000000000000000000000\",\"tenants\":[]}",
            "{\"name\":\"a\",\"sha256\":\"0000000000000000000000000000000000000000000000000000000000000000\",\"tenants\":[\"a\\u0000\"]}",
            "{\"name\":\"a\",\"sha256\":\"0000000000000000000000000000000000000000000000000000000000000000\",\"admin\":true}",
        ] {
            assert!(Tokens::parse(bad).is_err(), "{bad:?} was accepted");
        }
        let dup = format!(
            "{}\n{}",
            Tokens::line_for("a", "x", None, false),
            Tokens::line_for("a", "y", None, false)
        );
        assert!(Tokens::parse(&dup).is_err());
    }

    proptest::proptest! {
        /// Any token file text, and any line `line_for` can print, is a
        /// set of tokens or a `token_file` error.
        #[test]
        fn any_token_file_parses_or_is_a_token_file_error(
            text in proptest::prelude::any::<String>(),
            name in "[ -~]{0,70}",
            tenants in proptest::option::of(proptest::collection::vec(proptest::prelude::any::<String>(), 0..3)),
            payloads in proptest::prelude::any::<bool>(),
        ) {
            for text in [text, Tokens::line_for(&name, "token", tenants.as_deref(), payloads)] {
                if let Err(e) = Tokens::parse(&text) {
                    proptest::prop_assert_eq!(e.code(), "token_file");
                }
            }
        }
    }

    #[test]
    fn scope_defaults_and_refusals() {
        let auth = Auth::new(tokens(), Duration::from_secs(60));
        let root = auth.bearer("s3cret").unwrap();
        assert_eq!(root.scope(None).unwrap(), None);
        assert_eq!(root.scope(Some("x")).unwrap().as_deref(), Some("x"));
        let acme = auth.bearer("other").unwrap();
        assert_eq!(acme.scope(None).unwrap().as_deref(), Some("acme"));
        assert_eq!(acme.scope(Some(" ")).unwrap().as_deref(), Some("acme"));
        assert!(acme.scope(Some("globex")).is_err());
        assert!(acme.check("globex").is_err());
    }
}
