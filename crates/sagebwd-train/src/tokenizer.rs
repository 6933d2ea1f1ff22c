//! GPT-2 byte-pair encoding (r50k_base, 50257 tokens) through `tiktoken-rs`, whose vocabulary is
//! compiled into the crate: nothing is downloaded.

use tiktoken_rs::CoreBPE;

/// The end-of-text token, placed after every document.
pub const EOT: u32 = 50256;

pub struct Tokenizer {
    bpe: &'static CoreBPE,
}

impl Tokenizer {
    pub fn gpt2() -> Tokenizer {
        Tokenizer {
            bpe: tiktoken_rs::r50k_base_singleton(),
        }
    }

    /// Tokens of `text`, treating any `<|endoftext|>` in it as ordinary text (documents are
    /// delimited by the corpus format, never by strings inside them).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// The text of `tokens` (invalid UTF-8 sequences replaced).
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes = self.bpe.decode_bytes(tokens).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Bytes of text each token id stands for (EOT: 0, it is not text); used for bits per byte.
    pub fn token_byte_lengths(&self, vocab: usize) -> Vec<u32> {
        (0..vocab as u32)
            .map(|t| {
                if t == EOT {
                    0
                } else {
                    self.bpe.decode_bytes(&[t]).map(|b| b.len() as u32).unwrap_or(0)
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_encoding_matches_known_ids_and_round_trips() {
        let tok = Tokenizer::gpt2();
        // "Hello world" is [15496, 995] in GPT-2's vocabulary.
        assert_eq!(tok.encode("Hello world"), vec![15496, 995]);
        let text = "Alice was beginning to get very tired <|endoftext|> of sitting.";
        let ids = tok.encode(text);
        assert!(!ids.contains(&EOT), "special-token text must stay ordinary text");
        assert_eq!(tok.decode(&ids), text);
        let lens = tok.token_byte_lengths(50257);
        assert_eq!(lens[15496], 5);
        assert_eq!(lens[EOT as usize], 0);
        assert_eq!(
            ids.iter().map(|&t| lens[t as usize] as usize).sum::<usize>(),
            text.len()
        );
    }
}
