//! The HTML page shell every report shares: escaping, the inline stylesheet, the small inline
//! script (table sorting, copy button; the page reads fully without it), and helpers for number
//! cells. No external resources: the page works offline and from an attachment.

/// Escapes text for HTML element content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A float for a table cell in scientific notation: `inf`, `NaN`, `0` spelled out.
pub fn sci(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.2e}")
    }
}

const CSS: &str = r#"
:root{--red:#c81e1e;--green:#2e7d32;--ink:#1f2328;--mute:#59636e;--line:#d8dee4;--bg:#f6f8fa}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--ink);background:var(--bg)}
main{max-width:1180px;margin:0 auto;padding:18px 22px 60px}
header h1{font-size:20px;margin:0 0 2px}
header .meta{color:var(--mute);font-size:13px}
code,pre{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
section{background:#fff;border:1px solid var(--line);border-radius:8px;padding:14px 18px;margin:16px 0}
section h2{font-size:16px;margin:0 0 4px}
.how{color:var(--mute);font-size:13px;margin:0 0 8px}
.diag{border-left:8px solid var(--red)}
.diag.agree{border-left-color:var(--green)}
.verdict{font-size:26px;font-weight:800;letter-spacing:.5px;color:var(--red)}
.agree .verdict{color:var(--green)}
.where{font-size:17px;margin:2px 0 8px}
.where code{font-size:16px;background:#fdecec;padding:1px 6px;border-radius:4px}
.chip{display:inline-block;font-weight:700;padding:2px 10px;border-radius:12px;background:var(--red);color:#fff}
.conf{color:var(--mute);margin-left:6px}
.evidence{font-size:16px;margin:10px 0;padding:8px 12px;background:#fff8f8;border-radius:6px}
.agree .evidence{background:#f3faf3}
.iso{margin:4px 0 10px;padding-left:20px;color:var(--ink)}
.repro{display:flex;gap:8px;align-items:flex-start}
.repro pre{flex:1;margin:0;padding:8px 10px;background:#0d1117;color:#e6edf3;border-radius:6px;white-space:pre-wrap;word-break:break-all;user-select:all}
.repro button{padding:6px 12px;border:1px solid var(--line);border-radius:6px;background:#fff;cursor:pointer}
.stats{display:flex;flex-wrap:wrap;gap:8px 22px;color:var(--mute);font-size:13px;margin-top:10px}
.warn{margin:.4rem 0;padding:.3rem .6rem;border-left:3px solid #b26a00;background:#fff8e6}
.stats b{color:var(--ink)}
.chart svg{display:block;max-width:100%;height:auto}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12.5px;margin:6px 0 0}
.legend i{display:inline-block;width:18px;height:4px;vertical-align:middle;margin-right:5px;border-radius:2px}
.legend .thick{height:6px}
.reading{font-weight:600;margin:6px 0 0}
table{border-collapse:collapse;width:100%;font-size:12.5px}
th,td{padding:3px 8px;border-bottom:1px solid #eef1f4;text-align:right;white-space:nowrap}
th{background:#f0f3f6;position:sticky;top:0;cursor:pointer;user-select:none}
td:nth-child(2),th:nth-child(2),td:nth-child(3),th:nth-child(3){text-align:left}
td:nth-child(2){font-family:ui-monospace,Menlo,Consolas,monospace}
tr.o td{color:var(--red)}
tr.f td{background:#fde2e2;font-weight:700}
details summary{cursor:pointer;font-weight:600}
.scroll{max-height:640px;overflow:auto;border:1px solid var(--line);border-radius:6px}
footer{color:var(--mute);font-size:12px;margin-top:20px}
"#;

const JS: &str = r#"
(function(){
function key(r,i){var t=r.cells[i].textContent;if(t==='inf'||t==='NaN')return[0,Infinity];var v=parseFloat(t);return isNaN(v)?[1,t]:[0,v];}
document.querySelectorAll('table.sort').forEach(function(tb){
tb.querySelectorAll('th').forEach(function(th,i){th.title='click to sort';th.addEventListener('click',function(){
var body=tb.tBodies[0],rows=Array.prototype.slice.call(body.rows),d=th.getAttribute('data-d')==='1'?-1:1;
th.setAttribute('data-d',d===1?'1':'0');
rows.sort(function(a,b){var x=key(a,i),y=key(b,i);if(x[0]!==y[0])return(x[0]-y[0])*d;return(x[1]<y[1]?-1:x[1]>y[1]?1:0)*d;});
rows.forEach(function(r){body.appendChild(r);});});});});
var b=document.getElementById('copy');
if(b)b.addEventListener('click',function(){var t=document.getElementById('repro').textContent;
function done(){b.textContent='copied';setTimeout(function(){b.textContent='copy';},1500);}
function fallback(){var s=window.getSelection(),r=document.createRange();r.selectNodeContents(document.getElementById('repro'));s.removeAllRanges();s.addRange(r);try{document.execCommand('copy');done();}catch(e){}}
if(navigator.clipboard&&window.isSecureContext){navigator.clipboard.writeText(t).then(done,fallback);}else{fallback();}});
})();
"#;

/// A whole self-contained page: `<head>` with the stylesheet, `body` inside `<main>`, the
/// script at the end. `title` is escaped; `body` is trusted HTML built by this crate.
pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8><meta name=viewport content=\"width=device-width,initial-scale=1\"><title>{}</title><style>{CSS}</style></head>\n<body><main>\n{body}\n</main><script>{JS}</script></body></html>\n",
        escape(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(escape(r#"<a href="x">&'"#), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
    }

    #[test]
    fn sci_spells_out_nonfinite() {
        assert_eq!(sci(f64::NAN), "NaN");
        assert_eq!(sci(f64::INFINITY), "inf");
        assert_eq!(sci(0.0), "0");
        assert_eq!(sci(1.5e-3), "1.50e-3");
    }
}
