//! Images in chat messages: OpenAI's `image_url` parts with a `data:image/png;base64,`
//! URL (no fetching: a plugin has no network), decoded to RGB for the host's projector.

use crate::api::ApiError;
use crate::template::Span;
use llamabox_guest::media::Image;

/// The host's `max-image-side`: larger images are refused before they are decoded.
const MAX_IMAGE_SIDE: u32 = 2048;

/// What stands for an image in the text given to the chat template; replaced by the
/// projector's own marker once it is open.
pub const MARKER: &str = "<__media__>";

/// A piece of a chat prompt with images, in order.
#[derive(Debug, PartialEq)]
pub enum Segment<'a> {
    /// The template's text: special tokens parsed.
    Template(&'a str),
    /// A message's text: plain.
    Text(&'a str),
    /// Where the next image goes.
    Media,
}

/// `prompt` as its `spans` cut it, each message text cut again at its markers (which
/// image parts put there: the request's own text may not spell one, see
/// `handlers::chat_messages`). A marker in the template's pieces is not an image.
pub fn segments<'a>(prompt: &'a str, spans: &[Span]) -> Vec<Segment<'a>> {
    let mut out = Vec::new();
    for span in spans {
        let text = &prompt[span.start..span.end];
        if !span.message {
            out.push(Segment::Template(text));
            continue;
        }
        for (k, piece) in text.split(MARKER).enumerate() {
            if k > 0 {
                out.push(Segment::Media);
            }
            if !piece.is_empty() {
                out.push(Segment::Text(piece));
            }
        }
    }
    out
}

/// The projector to use with `model`, from `LLAMABOX_VISION` (`model=projector,...`).
pub fn projector_for(model: &str) -> Option<String> {
    let pairs = std::env::var("LLAMABOX_VISION").ok()?;
    pairs.split(',').find_map(|pair| {
        let (m, p) = pair.split_once('=')?;
        (m.trim() == model).then(|| p.trim().to_string())
    })
}

/// An `image_url` part's URL as an image; `param` names the part in errors.
pub fn decode(url: &str, param: &str) -> Result<Image, ApiError> {
    let invalid = |why: &str| ApiError::invalid(format!("Invalid image: {why}"), Some(param));
    let Some(data) = url.strip_prefix("data:image/png;base64,") else {
        return Err(invalid(
            "only data:image/png;base64 URLs are served (a plugin fetches nothing)",
        ));
    };
    let bytes = unbase64(data).ok_or_else(|| invalid("the data is not base64"))?;
    let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(|e| invalid(&format!("not a PNG ({e})")))?;
    let (width, height) = (reader.info().width, reader.info().height);
    if width == 0 || height == 0 || width > MAX_IMAGE_SIDE || height > MAX_IMAGE_SIDE {
        return Err(invalid(&format!(
            "{width}x{height} pixels; each side must be 1..={MAX_IMAGE_SIDE}"
        )));
    }
    let mut pixels = vec![0; reader.output_buffer_size()];
    let frame =
        reader.next_frame(&mut pixels).map_err(|e| invalid(&format!("a broken PNG ({e})")))?;
    pixels.truncate(frame.buffer_size());
    let rgb = match frame.color_type {
        png::ColorType::Rgb => pixels,
        png::ColorType::Rgba => pixels.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => pixels.iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => {
            pixels.chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect()
        }
        png::ColorType::Indexed => return Err(invalid("an indexed PNG that was not expanded")),
    };
    Ok(Image { width, height, rgb })
}

/// Standard base64 (padding optional); `None` on any other character.
fn unbase64(text: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let text = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for group in text.chunks(4) {
        let n = group.iter().try_fold(0u32, |n, &c| Some(n << 6 | u32::from(digit(c)?)))?
            << (6 * (4 - group.len()));
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..group.len()]);
    }
    Some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for bytes in [&b""[..], b"a", b"ab", b"abc", b"abcd", &[0, 255, 128, 7, 9]] {
            assert_eq!(unbase64(&crate::api::base64(bytes)).as_deref(), Some(bytes));
        }
        assert_eq!(unbase64("a*b="), None);
    }

    /// A 1x1 PNG as a data URL.
    pub(crate) fn png_url() -> String {
        let mut bytes = Vec::new();
        let mut encoder = png::Encoder::new(&mut bytes, 1, 1);
        encoder.set_color(png::ColorType::Rgb);
        encoder.write_header().unwrap().write_image_data(&[1, 2, 3]).unwrap();
        format!("data:image/png;base64,{}", crate::api::base64(&bytes))
    }

    #[test]
    fn a_png_data_url_decodes() {
        let image = decode(&png_url(), "p").unwrap();
        assert_eq!((image.width, image.height, image.rgb), (1, 1, vec![1, 2, 3]));
    }

    #[test]
    fn images_are_found_in_the_messages_texts_only() {
        let prompt = "<s>user\nSee <__media__> and<__media__></s><__media__>";
        let end = prompt.find("</s>").unwrap();
        let spans = [
            Span { start: 0, end: 8, message: false },
            Span { start: 8, end, message: true },
            Span { start: end, end: prompt.len(), message: false },
        ];
        assert_eq!(&prompt[8..end], "See <__media__> and<__media__>");
        assert_eq!(
            segments(prompt, &spans),
            [
                Segment::Template("<s>user\n"),
                Segment::Text("See "),
                Segment::Media,
                Segment::Text(" and"),
                Segment::Media,
                Segment::Template("</s><__media__>"),
            ]
        );
    }
}
