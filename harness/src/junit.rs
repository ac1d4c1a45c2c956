//! JUnit XML for `gate --junit`: `<testsuites>` with one `<testsuite>` per golden file and one
//! `<testcase>` per tap group (embed, each layer, output) and per prompt's positions. Written by hand
//! (no XML dependency): every attribute and text value goes through [`escape`].

use std::fmt::Write;

/// One test case.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub classname: String,
    pub seconds: f64,
    /// `Some((message, details))` when it failed.
    pub failure: Option<(String, String)>,
    /// `Some(reason)` when it was skipped.
    pub skipped: Option<String>,
}

/// One test suite.
#[derive(Clone, Debug)]
pub struct Suite {
    pub name: String,
    pub seconds: f64,
    pub properties: Vec<(String, String)>,
    pub cases: Vec<Case>,
    /// `Some(message)` when the suite could not run at all (reported as one errored case).
    pub error: Option<String>,
}

/// Escapes text for XML attributes and character data, dropping characters XML 1.0 forbids.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// The XML document.
pub fn render(suites: &[Suite]) -> String {
    let count = |s: &Suite| {
        (
            s.cases.len() + usize::from(s.error.is_some()),
            s.cases.iter().filter(|c| c.failure.is_some()).count(),
            usize::from(s.error.is_some()),
            s.cases.iter().filter(|c| c.skipped.is_some()).count(),
        )
    };
    let (mut t, mut f, mut e, mut sk, mut secs) = (0, 0, 0, 0, 0.0);
    for s in suites {
        let (a, b, c, d) = count(s);
        t += a;
        f += b;
        e += c;
        sk += d;
        secs += s.seconds;
    }
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        x,
        "<testsuites name=\"llmdiff gate\" tests=\"{t}\" failures=\"{f}\" errors=\"{e}\" skipped=\"{sk}\" time=\"{secs:.3}\">"
    );
    for s in suites {
        let (a, b, c, d) = count(s);
        let _ = writeln!(
            x,
            "  <testsuite name=\"{}\" tests=\"{a}\" failures=\"{b}\" errors=\"{c}\" skipped=\"{d}\" time=\"{:.3}\">",
            escape(&s.name),
            s.seconds
        );
        if !s.properties.is_empty() {
            x.push_str("    <properties>\n");
            for (k, v) in &s.properties {
                let _ = writeln!(x, "      <property name=\"{}\" value=\"{}\"/>", escape(k), escape(v));
            }
            x.push_str("    </properties>\n");
        }
        if let Some(err) = &s.error {
            let _ = writeln!(
                x,
                "    <testcase name=\"load\" classname=\"{}\" time=\"0\">\n      <error message=\"{}\" type=\"error\"/>\n    </testcase>",
                escape(&s.name),
                escape(err)
            );
        }
        for c in &s.cases {
            let head = format!(
                "    <testcase name=\"{}\" classname=\"{}\" time=\"{:.3}\"",
                escape(&c.name),
                escape(&c.classname),
                c.seconds
            );
            match (&c.failure, &c.skipped) {
                (Some((msg, details)), _) => {
                    let _ = writeln!(
                        x,
                        "{head}>\n      <failure message=\"{}\" type=\"tolerance\">{}</failure>\n    </testcase>",
                        escape(msg),
                        escape(details)
                    );
                }
                (None, Some(why)) => {
                    let _ = writeln!(
                        x,
                        "{head}>\n      <skipped message=\"{}\"/>\n    </testcase>",
                        escape(why)
                    );
                }
                (None, None) => {
                    let _ = writeln!(x, "{head}/>");
                }
            }
        }
        x.push_str("  </testsuite>\n");
    }
    x.push_str("</testsuites>\n");
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_control_chars() {
        assert_eq!(escape("a<b & \"c\"\u{1}"), "a&lt;b &amp; &quot;c&quot;\u{FFFD}");
    }

    #[test]
    fn counts_add_up() {
        let case = |fail: bool| Case {
            name: "n".into(),
            classname: "c".into(),
            seconds: 0.0,
            failure: fail.then(|| ("m".into(), "d".into())),
            skipped: None,
        };
        let xml = render(&[Suite {
            name: "s".into(),
            seconds: 1.0,
            properties: vec![("k".into(), "v".into())],
            cases: vec![case(false), case(true)],
            error: None,
        }]);
        assert!(xml.contains("tests=\"2\" failures=\"1\""), "{xml}");
    }
}
